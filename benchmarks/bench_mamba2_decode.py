"""End-to-end decode of a random-weight Mamba2-2.7B-shaped model on the GPU: tokens/s at batch 1
and 64, plain and with ngram speculation, and the bytes a step must move against the device copy
bandwidth measured in the same run.

Shape (state-spaces/mamba2-2.7b): 64 layers, d_model 2560, 80 heads x 64 head dim, state 128,
1 group, conv width 4, vocab 50288, bf16 weights, fp32 SSM state. Prompts are token ids: a random
16-token pattern repeated, so that the ngram proposer finds candidates; whether the random model
continues the pattern decides the acceptance, which the JSON records. Hybrid models run their
decode/verify steps replay CUDA graphs (prefill steps run eagerly).

    python benchmarks/bench_mamba2_decode.py --out benchmarks/results/mamba2_decode_h100.json
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_decode import llm_from_model, sync_time  # noqa: E402
from gpu_timing import copy_bandwidth_gbps, write_result, run_header  # noqa: E402

from pyengine import LLM, SamplingParams  # noqa: E402

MAMBA2_2_7B = dict(architectures=["Mamba2ForCausalLM"], vocab_size=50288, hidden_size=2560, num_hidden_layers=64,
                   num_heads=80, head_dim=64, state_size=128, n_groups=1, conv_kernel=4, expand=2,
                   chunk_size=256, use_bias=False, use_conv_bias=True, layer_norm_epsilon=1e-5,
                   tie_word_embeddings=True, max_position_embeddings=4096, eos_token_id=0)


def random_mamba2(dtype=torch.bfloat16):
    from pyengine.models.mamba2 import Mamba2ForCausalLM, mamba2_model_config

    cfg = mamba2_model_config(MAMBA2_2_7B)
    with torch.device("cuda"):
        model = Mamba2ForCausalLM(cfg, dtype)
    gen = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):  # A in [-16, -1], as Mamba2's initialisation
                p.copy_(torch.log(torch.empty_like(p, dtype=torch.float32).uniform_(1, 16, generator=gen)))
            elif name.endswith("dt_bias"):  # softplus(dt_bias) in [1e-3, 1e-1]
                dt = torch.exp(torch.empty_like(p, dtype=torch.float32).uniform_(math.log(1e-3), math.log(1e-1),
                                                                                  generator=gen))
                p.copy_(dt + torch.log(-torch.expm1(-dt)))
            elif name.endswith(".D") or "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    return model.eval(), cfg


def make_llm(model, cfg, max_num_seqs: int, spec: dict | None) -> LLM:
    # num_kv_blocks left to the default: the model has no attention layers, so the (tiny) KV
    # pool is sized never to limit admission
    return llm_from_model(model, cfg, device="cuda", max_num_seqs=max_num_seqs, max_model_len=1024,
                          speculative_config=spec)


def state_bytes_per_row(cfg) -> int:
    """Bytes one decode token moves in recurrent state: SSM state read + written (fp32), conv
    window read + written (bf16)."""
    ssm = cfg.num_ssm_heads * cfg.ssm_head_dim * cfg.state_size * 4 * 2
    conv_dim = cfg.num_ssm_heads * cfg.ssm_head_dim + 2 * cfg.n_groups * cfg.state_size
    conv = conv_dim * (cfg.conv_kernel - 1) * 2 * 2
    return cfg.num_hidden_layers * (ssm + conv)


def run(llm: LLM, batch: int, prompt_len: int, new_tokens: int) -> dict:
    g = torch.Generator().manual_seed(batch)
    prompts = []
    for _ in range(batch):
        pattern = torch.randint(10, 50000, (16,), generator=g).tolist()
        prompts.append((pattern * (prompt_len // 16 + 1))[:prompt_len])
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm-up
    before = llm.stats()
    eng = llm.engine
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    for p in prompts:
        eng.add_request(p, params)
    decode_s, tokens, steps = 0.0, 0, 0
    while eng.has_unfinished():
        pre, dec = eng.counters["prefill_tokens"], eng.counters["decode_tokens"]
        t0 = sync_time()
        eng.step()
        dt = sync_time() - t0
        if eng.counters["prefill_tokens"] == pre:
            decode_s += dt
            tokens += eng.counters["decode_tokens"] - dec
            steps += 1
    after = llm.stats()
    drafted = after.get("num_draft_tokens", 0) - before.get("num_draft_tokens", 0)
    accepted = after.get("num_accepted_tokens", 0) - before.get("num_accepted_tokens", 0)
    return {"batch": batch, "tokens_per_s": tokens / decode_s, "decode_steps": steps,
            "mean_step_ms": 1e3 * decode_s / steps, "tokens_per_step": tokens / steps,
            "num_draft_tokens": drafted, "acceptance_rate": accepted / drafted if drafted else None}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--num-spec-tokens", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/mamba2_decode_h100.json")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    copy_bw = copy_bandwidth_gbps()
    model, cfg = random_mamba2()
    weight_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n != "embeddings")
    weight_bytes += cfg.vocab_size * cfg.hidden_size * 2  # the tied head is read by every step
    result = {**run_header(),
              "copy_bandwidth_GBps": copy_bw, "shape": MAMBA2_2_7B, "weight_bytes": weight_bytes,
              "state_bytes_per_row": state_bytes_per_row(cfg), "prompt_len": args.prompt_len,
              "new_tokens": args.new_tokens, "cuda_graphs": True, "plain": [], "ngram": []}
    spec = {"method": "ngram", "num_speculative_tokens": args.num_spec_tokens, "prompt_lookup_max": 4,
            "prompt_lookup_min": 2}
    for mode, spec_cfg in (("plain", None), ("ngram", spec)):
        llm = make_llm(model, cfg, max(batches), spec_cfg)
        for b in batches:
            r = run(llm, b, args.prompt_len, args.new_tokens)
            step_bytes = weight_bytes + b * result["state_bytes_per_row"]
            r["bandwidth_utilisation"] = step_bytes / (r["mean_step_ms"] / 1e3) / (copy_bw * 1e9)
            result[mode].append(r)
            print(f"mamba2-2.7b {mode} batch {b}: {r['tokens_per_s']:.1f} tok/s, step {r['mean_step_ms']:.2f} ms, "
                  f"{r['tokens_per_step']:.2f} tok/step, utilisation {r['bandwidth_utilisation']:.3f}, "
                  f"acceptance {r['acceptance_rate']}", flush=True)
        del llm
        torch.cuda.empty_cache()
    write_result(args.out, result)


if __name__ == "__main__":
    main()
