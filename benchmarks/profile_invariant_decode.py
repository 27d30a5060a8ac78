"""Where a SmolLM2- or Llama-8B-shaped decode step (and a long prefill) spends GPU time, default
path vs LLM(batch_invariant=True): random weights, eager (enforce_eager, so torch.profiler sees every
kernel; --graphs: decode steps on CUDA graphs as served, whose kernels CUPTI records too, a PDL
kernel's time then including its wait for the one before), batch B, 32-token prompts, 17 new
tokens; then, with --prefill N, one N-token prompt (max_tokens 1). Prints each mode's top CUDA
kernels by total time, per phase, and their totals by kind (GEMM, attention, norm, ...).

    python3 benchmarks/profile_invariant_decode.py 64 [smollm2|llama8b] [--prefill 4096] [--rows 18] [--graphs]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_decode import LLAMA8B_HF, SMOLLM2_HF, llm_from_model, random_llama  # noqa: E402

from pyengine import SamplingParams  # noqa: E402


# Kernel kinds by name fragment, first match wins (cuBLAS kernels: nvjet / sm90_xmma / cutlass / gemm).
KINDS = (("attention", ("paged_attention", "attention_combine", "combine_kernel")),
         ("gemm", ("gemm", "nvjet", "xmma", "cutlass", "wgmma")),
         ("norm", ("rms_norm", "norm_kernel")), ("rope+cache", ("rope", "cache")))


def kind_of(name: str) -> str:
    low = name.lower()
    return next((kind for kind, frags in KINDS if any(f in low for f in frags)), "other")


def kernel_table(prof, rows: int) -> str:
    """Top kernels by total device time: ms, calls, share, name (cut to 90 characters); then the
    totals by kind."""
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA or
              getattr(e, "self_device_time_total", 0) > 0]
    events.sort(key=lambda e: e.self_device_time_total, reverse=True)
    total = sum(e.self_device_time_total for e in events) or 1.0
    lines = [f"  total {total / 1e3:9.3f} ms"]
    for e in events[:rows]:
        lines.append(f"  {e.self_device_time_total / 1e3:9.3f} ms {e.count:6d}x {100 * e.self_device_time_total / total:5.1f}%"
                     f"  {e.key[:90]}")
    kinds: dict[str, list[float]] = {}
    for e in events:
        k = kinds.setdefault(kind_of(e.key), [0.0, 0])
        k[0] += e.self_device_time_total
        k[1] += e.count
    lines.append("  by kind: " + ", ".join(f"{k} {v[0] / 1e3:.3f} ms / {v[1]}x" for k, v in
                                           sorted(kinds.items(), key=lambda kv: -kv[1][0])))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("batch", type=int, nargs="?", default=64)
    ap.add_argument("shape", nargs="?", default="smollm2", choices=["smollm2", "llama8b"])
    ap.add_argument("--prefill", type=int, default=0, help="also profile one prompt of this many tokens")
    ap.add_argument("--rows", type=int, default=18)
    ap.add_argument("--graphs", action="store_true", help="decode steps on CUDA graphs (not eager)")
    args = ap.parse_args()
    model, cfg = random_llama(LLAMA8B_HF if args.shape == "llama8b" else SMOLLM2_HF, torch.bfloat16)
    max_len = max(1024, args.prefill + 64)
    for invariant in (False, True):
        llm = llm_from_model(model, cfg, device="cuda", num_kv_blocks=4096 + args.prefill // 16, max_model_len=max_len,
                             max_num_seqs=args.batch, max_num_batched_tokens=max(args.prefill, 2048),
                             batch_invariant=invariant, dtype=torch.bfloat16, enforce_eager=not args.graphs)
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(10, cfg.vocab_size - 1, (32,), generator=g).tolist() for _ in range(args.batch)]
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            llm.generate(prompts, SamplingParams(temperature=0, max_tokens=17, ignore_eos=True), use_tqdm=False)
        print(f"==== batch_invariant={invariant} decode batch {args.batch} ({args.shape}, "
              f"{'graphs' if args.graphs else 'eager'})")
        print(kernel_table(prof, args.rows), flush=True)
        if args.prefill:
            one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
            for rep in range(2):  # the first one warms up
                prompt = torch.randint(10, cfg.vocab_size - 1, (args.prefill,), generator=g).tolist()
                if rep == 0:
                    llm.generate([prompt], one, use_tqdm=False)
                    continue
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    llm.generate([prompt], one, use_tqdm=False)
            print(f"==== batch_invariant={invariant} prefill {args.prefill} ({args.shape})")
            print(kernel_table(prof, args.rows), flush=True)
        del llm
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
