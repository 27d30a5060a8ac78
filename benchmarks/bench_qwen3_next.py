"""Qwen3-Next at real widths (Qwen3-Next-80B-A3B's layer shapes), few layers (3 Gated DeltaNet + 1
gated attention, MoE everywhere), random bf16 weights, on the GPU: decode step time at several
batch sizes and the cost of a speculative verify step (1 + k tokens per row, every token's
recurrent state written to its own slot) against a decode step, measured in the same run, both
eager (the Python launch loop) and replayed from a CUDA graph (what the engine's decode/verify
steps run: the MoE's grouped path reads nothing on the host).

--e2e: decode tokens/s through the engine (LLM around the random model, CUDA graphs, greedy, random
token prompts) at each batch size, plain and with ngram speculation (k = 4, adaptive), in the same
run; with random weights the acceptance is whatever the model's output repeats, reported beside it.

    python3 benchmarks/bench_qwen3_next.py --out benchmarks/results/qwen3_next_h100.json
    python3 benchmarks/bench_qwen3_next.py --e2e --out benchmarks/results/qwen3_next_e2e_h100.json
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.bench_decode import llm_from_model, run_pyengine  # noqa: E402
from benchmarks.bench_deepseek_v3 import record_step, step_inputs  # noqa: E402
from benchmarks.gpu_timing import copy_bandwidth_gbps, run_header, time_ms, time_ms_graph, write_result  # noqa: E402
from pyengine.engine.state_cache import StateCache, StateMetadata  # noqa: E402
from pyengine.models.qwen3_next import Qwen3NextForCausalLM, qwen3_next_model_config  # noqa: E402

QWEN3_NEXT_80B = dict(architectures=["Qwen3NextForCausalLM"], vocab_size=151936, hidden_size=2048,
                      intermediate_size=5120, num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=2,
                      head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                      linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=512, num_experts_per_tok=10,
                      moe_intermediate_size=512, shared_expert_intermediate_size=512, max_position_embeddings=16384,
                      full_attention_interval=4, rope_parameters={"rope_theta": 10000000.0, "partial_rotary_factor": 0.25})


def build() -> Qwen3NextForCausalLM:
    cfg = qwen3_next_model_config(QWEN3_NEXT_80B)
    with torch.device("cuda"):
        model = Qwen3NextForCausalLM(cfg, torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name.split(".")[-1] or name.endswith("conv_weight"):
                p.normal_(1.0 if "norm" in name else 0.0, 0.1)
            elif name.endswith("A_log"):
                p.uniform_(0.0, 1.5)
            else:
                p.normal_(0.0, 0.02)
    return model.eval()


def end_to_end(model: Qwen3NextForCausalLM, batches: list[int], prompt_len: int, new_tokens: int) -> list[dict]:
    """Engine decode tokens/s, plain and ngram (k = 4, adaptive), per batch size."""
    cfg = qwen3_next_model_config(QWEN3_NEXT_80B)
    rows = []
    for batch in batches:
        row: dict = {"batch": batch, "prompt_len": prompt_len, "new_tokens": new_tokens}
        for name, spec in (("plain", None), ("ngram", {"method": "ngram", "num_speculative_tokens": 4})):
            llm = llm_from_model(model, cfg, device="cuda", dtype="bfloat16", max_num_seqs=batch,
                                 max_model_len=prompt_len + new_tokens + 64, gpu_memory_utilization=0.6,
                                 speculative_config=spec)
            res = run_pyengine(llm, batch, prompt_len, new_tokens, QWEN3_NEXT_80B["vocab_size"])
            res["acceptance_rate"] = llm.stats().get("acceptance_rate")
            row[name] = {k: res[k] for k in ("tokens_per_s", "median_step_ms", "decode_steps", "acceptance_rate")}
            del llm
            gc.collect()
            torch.cuda.empty_cache()
        row["ngram_vs_plain"] = round(row["ngram"]["tokens_per_s"] / row["plain"]["tokens_per_s"], 3)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--ks", default="1,2,3")
    ap.add_argument("--e2e", action="store_true", help="engine tokens/s, plain vs ngram, instead of step costs")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.e2e:
        model = build()
        result = dict(run_header(), model=QWEN3_NEXT_80B,
                      rows=end_to_end(model, [int(b) for b in args.batches.split(",")], args.prompt_len,
                                      args.new_tokens))
        if args.out:
            write_result(args.out, result)
        return
    ks = [int(k) for k in args.ks.split(",")]
    copy = copy_bandwidth_gbps()
    model = build()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    result = dict(run_header(), copy_bandwidth_gbps=copy, model=QWEN3_NEXT_80B, context=args.context,
                  weight_bytes=weight_bytes, rows=[])
    for batch in [int(b) for b in args.batches.split(",")]:
        row: dict = {"batch": batch}
        pool = StateCache(model.state_shapes(max(ks)), batch * (1 + max(ks)), torch.bfloat16, torch.device("cuda"))
        for k in [0] + ks:
            q_len = 1 + k
            ids, pos, meta, blocks = step_inputs(batch, args.context, q_len, vocab=QWEN3_NEXT_80B["vocab_size"])
            caches = model.make_kv_caches(blocks, 64, torch.device("cuda"))
            for c in caches:
                if c is not None:
                    c[0].normal_(), c[1].normal_()
            idx = torch.arange(batch * (1 + max(ks)), dtype=torch.int32, device="cuda").view(batch, -1)
            state = StateMetadata(conv=pool.conv, ssm=pool.ssm, state_idx=idx,
                                  num_accepted=torch.full((batch,), 1, dtype=torch.int32, device="cuda"),
                                  has_initial_state=torch.ones(batch, dtype=torch.bool, device="cuda"),
                                  query_start_loc=meta.query_start_loc, num_decode_rows=batch,
                                  num_decode_tokens=batch * q_len)
            with torch.inference_mode():
                step = lambda: model.compute_logits(model(ids, pos, meta, caches, state=state)[-batch:])  # noqa: E731
                ms = time_ms(step, reps=10)
                graph_ms = time_ms_graph(step, inner=5, reps=5)  # what the engine's CUDA graphs replay
            record_step(row, k, batch, ms, graph_ms)
            del caches
            torch.cuda.empty_cache()
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        write_result(args.out, result)


if __name__ == "__main__":
    main()
