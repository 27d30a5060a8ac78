"""pyengine's skinny decode GEMM (hipkernels/gemm/skinny_gemm.hip) against cuBLAS (torch.mm) on the
Llama-3-8B projections, [in, out] weights, as a fraction of the copy bandwidth measured in the same
run. Timed as bench_gemm_layouts.py times cuBLAS: inside CUDA graphs of back-to-back calls, each
call on another copy of the weight (more bytes than L2 holds), median of replays.

Rows per (shape, M): cuBLAS; the skinny GEMM's default configuration launched plainly; the same
with programmatic dependent launch (PDL: back to back, each call's first weight loads overlap the
previous call's end, as they overlap a norm or SwiGLU kernel in the decode step); at M = 1 also
every (split, tile_n) the kernel takes, which is what its default was chosen from.

    python3 benchmarks/bench_skinny_gemm.py --out benchmarks/results/skinny_gemm_h100.json
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_gemm_layouts import SHAPES, graph_ms, streamed_weight  # noqa: E402
from gpu_timing import copy_bandwidth_gbps, write_result, run_header  # noqa: E402

from pyengine.ops import cuda as cuda_ops  # noqa: E402
from pyengine.ops.cuda.launch import kernels as cuda_kernels  # noqa: E402

CONFIGS = [(split, tile_n) for tile_n in (64, 128) for split in (1, 2, 4, 8)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,2,4,8,16")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--sweep-at", default="1", help="batches at which every (split, tile_n) is timed")
    ap.add_argument("--out", default="benchmarks/results/skinny_gemm_h100.json")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    sweep_at = {int(b) for b in args.sweep_at.split(",") if b}
    bw = copy_bandwidth_gbps()
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    result: dict = {
        **run_header(),
        "copy_bandwidth_GBps": bw, "num_sms": num_sms, "rows": [],
    }
    print(f"copy bandwidth {bw:.0f} GB/s, {num_sms} SMs", flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name in args.shapes.split(","):
        k, n = SHAPES[name]
        base, nbytes, copies = streamed_weight(k, n, gen)
        ws = [base.clone() for _ in range(copies)]
        del base
        inner = max(copies, 16)
        default_tile = cuda_kernels.skinny_gemm_tile_n(n, num_sms)
        default_split = cuda_kernels.skinny_gemm_split(k, n, default_tile, num_sms)
        for m in batches:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
            variants = {"cublas": lambda w: torch.mm(x, w),
                        "skinny": lambda w: cuda_ops.skinny_gemm(x, w, pdl=False),
                        "skinny_pdl": lambda w: cuda_ops.skinny_gemm(x, w, pdl=True)}
            if m in sweep_at:
                for split, tile_n in CONFIGS:
                    variants[f"skinny_s{split}_t{tile_n}"] = (
                        lambda w, s=split, t=tile_n: cuda_ops.skinny_gemm(x, w, split=s, tile_n=t, pdl=False))
            line = []
            for label, fn in variants.items():
                ms = graph_ms([lambda i=i, fn=fn: fn(ws[i % copies]) for i in range(inner)])
                row = {"matrix": name, "k": k, "n": n, "m": m, "variant": label, "us": ms * 1e3,
                       "fraction_of_copy": nbytes / ms / 1e6 / bw}
                if label.startswith("skinny") and "_s" not in label:
                    row["split"], row["tile_n"] = default_split, default_tile
                result["rows"].append(row)
                line.append(f"{label} {ms * 1e3:.1f} us {row['fraction_of_copy']:.3f}")
            print(f"{name:8s} m={m:3d} | " + " | ".join(line), flush=True)
        ws.clear()
        torch.cuda.empty_cache()
    write_result(args.out, result)


if __name__ == "__main__":
    main()
