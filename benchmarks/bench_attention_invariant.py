"""What batch invariance costs attention: under KernelConfig.batch_invariant GQA splits a query's
keys at fixed multiples of SPLIT_BLOCK (ranges merged in order: workspace + combine for decode and
verify rows, inside the block for prefill rows); MLA sums the same fixed ranges (pyengine/ops/cuda/
mla.py; before 27ee066 it did not split, so a batch of few long rows left most SMs idle). Times the GQA (Llama-3-8B: 32 query heads,
8 KV heads, D 128, block 16) and MLA (DeepSeek-V3: 128 heads, 576 / 512, block 64) kernels with and
without the mode, same run, CUDA-graph timing, bf16: decode rows (q_len 1) at every batch and
context, then GQA prefill chunks at batch 1 (--prefill q_len:context pairs).

    python benchmarks/bench_attention_invariant.py --out benchmarks/results/attention_invariant_h100.json
"""
from __future__ import annotations

import argparse

import torch

from pyengine.ops import cuda as cuda_ops
from pyengine.ops.kernel_config import KernelConfig, use_kernel_config
from bench_attention import make_meta  # noqa: E402  (benchmarks/ is on sys.path)
from gpu_timing import time_ms_graph, write_result, run_header  # noqa: E402

SHAPES = {"gqa": (32, 8, 128, 128, 16), "mla": (128, 1, 576, 512, 64)}  # q heads, kv heads, D qk, D v, block


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/attention_invariant_h100.json")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--contexts", default="512,4096,16384,32768")
    ap.add_argument("--max-tokens", type=int, default=1 << 21, help="skip points with batch*ctx above this")
    ap.add_argument("--kinds", default="gqa,mla")
    ap.add_argument("--bound", type=int, default=0,
                    help="max_context_len of the step's metadata (0: the context), as a CUDA graph captured for "
                         "max_model_len keys sizes its split grid")
    ap.add_argument("--prefill", default="4096:4096,512:16384", help="GQA prefill chunks, q_len:context, batch 1")
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    rows = []
    for kind, (hq, hkv, dqk, dv, bs) in SHAPES.items():
        if kind not in args.kinds.split(","):
            continue
        nblocks = args.max_tokens // bs + 1
        shape = (nblocks, bs, dqk) if kind == "mla" else (nblocks, bs, hkv, dqk)
        k = torch.randn(*shape, device="cuda", dtype=torch.bfloat16)
        v = k if kind == "mla" else torch.randn_like(k)
        points = [(b, c, 1) for b in map(int, args.batches.split(",")) for c in map(int, args.contexts.split(","))]
        if kind == "gqa" and args.prefill:
            points += [(1, int(c), int(n)) for n, c in (x.split(":") for x in args.prefill.split(","))]
        for batch, ctx, q_len in points:
            if batch * ctx > args.max_tokens:
                continue
            meta = make_meta(batch, ctx, q_len, bs, nblocks, gen)
            meta.max_context_len = max(ctx, args.bound)
            q = torch.randn(batch * q_len, hq, dqk, device="cuda", dtype=torch.bfloat16)
            if kind == "mla":
                call = lambda: cuda_ops.paged_attention_mla(q, k, meta, 192 ** -0.5)  # noqa: E731
            else:
                call = lambda: cuda_ops.paged_attention(q, k, v, meta, dqk ** -0.5)  # noqa: E731
            ms = {}
            for invariant in (False, True):
                with use_kernel_config(KernelConfig(batch_invariant=invariant)):
                    ms[invariant] = time_ms_graph(call)
            row = {"kernel": kind, "batch": batch, "context": ctx, "q_len": q_len, "default_ms": ms[False],
                   "invariant_ms": ms[True], "ratio": ms[True] / ms[False]}
            rows.append(row)
            print(f"{kind} b={batch:3d} ctx={ctx:6d} q={q_len:5d} default {ms[False]:.4f} ms "
                  f"invariant {ms[True]:.4f} ms x{row['ratio']:.2f}", flush=True)
        k = v = None  # the next kind allocates its own cache
        torch.cuda.empty_cache()
    write_result(args.out, {**run_header(), "rows": rows})


if __name__ == "__main__":
    main()
