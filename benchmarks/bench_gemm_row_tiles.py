"""The batch-invariant GEMM's launch configurations at decode and verify sizes (issue 18): for
SmolLM2's and Llama-8B's projection shapes at M = 1, 16, 64 (--m), the default path (the skinny
GEMM at M = 1, cuBLAS above), the invariant GEMM as shipped, each family forced (mma.sync with its
default tile, wgmma), and (--sweep) every output tile of the mma.sync family (rows x columns) at
each K split of --splits ('rule': the shape's own). The tile and the family never change a bit
(InvariantGemmParams.tile_m / tile_n / family); the split does. Times are microseconds per GEMM
from CUDA-graph replays (PDL on, the KernelConfig's default), median of 10 replays:
  cold: the graph runs the GEMM over enough copies of the weight (>= 160 MB) that each streams from
        device memory, as in a model's decode step;
  hot:  the same weight 20 times (L2-resident where it fits, as bench_batch_invariant.py times).

    python3 benchmarks/bench_gemm_row_tiles.py [--sweep] [--splits 1,2,4,8] [--models smollm2,llama8b]
        [--m 1,16,64] [--out FILE.json]
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_batch_invariant import shapes  # noqa: E402
from bench_decode import LLAMA8B_HF, SMOLLM2_HF  # noqa: E402
from gpu_timing import graph_ms, run_header, write_result  # noqa: E402

from pyengine.ops import cuda as cuda_ops  # noqa: E402
from pyengine.ops.cuda.launch import kernels, num_sms, params, row_stride, stream  # noqa: E402

TILES = [(16, 32), (16, 64), (16, 128), (64, 32), (64, 64), (64, 128), (128, 128)]  # (rows, columns)
COLD_BYTES = 160 << 20


def graph_us(calls: list[Callable[[], object]], reps: int = 10) -> float:
    """Microseconds per call of one CUDA graph holding `calls` in order (median of reps replays)."""
    return 1e3 * graph_ms(calls, reps)


def invariant_call(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, split: int = 0,
                   tile: tuple[int, int] = (0, 0), family: int = 0) -> Callable[[], None]:
    p = params(kernels.InvariantGemmParams, x=x.data_ptr(), w=w.data_ptr(), y=y.data_ptr(), m=x.shape[0], n=w.shape[1],
               k=x.shape[1], x_stride=row_stride(x), y_stride=row_stride(y), dtype=1, num_sms=num_sms(x.device),
               split=split, tile_m=tile[0], tile_n=tile[1], family=family, pdl=True)
    return lambda: kernels.invariant_gemm(p, stream(x.device))  # the capturing stream, at call time


def default_call(x: torch.Tensor, w: torch.Tensor) -> Callable[[], object]:
    def run() -> object:
        y = cuda_ops.skinny_linear(x, w)
        return torch.mm(x, w) if y is None else y
    return run


def bench_shape(k: int, n: int, ms: list[int], sweep: bool, splits: list[int]) -> dict:
    copies = max(1, min(128, -(-COLD_BYTES // (2 * k * n))))
    ws = [(torch.randn(k, n, device="cuda") / k ** 0.5).bfloat16() for _ in range(copies)]
    out = {}
    for m in ms:
        x = torch.randn(m, k, device="cuda").bfloat16()
        ys = [torch.empty(m, n, dtype=x.dtype, device="cuda") for _ in ws]
        hot = [ws[0]] * 20
        row = {"weights": copies,
               "default_cold_us": graph_us([default_call(x, w) for w in ws]),
               "default_hot_us": graph_us([default_call(x, w) for w in hot]),
               "invariant_cold_us": graph_us([invariant_call(x, w, y) for w, y in zip(ws, ys)]),
               "invariant_hot_us": graph_us([invariant_call(x, w, ys[0]) for w in hot])}
        rule = kernels.invariant_gemm_split(k, n, num_sms(x.device))
        row["default_split"] = rule
        for name, family in (("mma_sync", 1), ("wgmma", 2)):
            row[f"{name}_cold_us"] = graph_us([invariant_call(x, w, y, family=family) for w, y in zip(ws, ys)])
        if sweep:
            grid = {}
            for split in (splits or [rule]):
                for tile in TILES:
                    calls = [invariant_call(x, w, y, split, tile, family=1) for w, y in zip(ws, ys)]
                    grid[f"s{split} {tile[0]}x{tile[1]}"] = graph_us(calls)
            best = min(grid, key=grid.get)
            row.update(sweep_cold_us=grid, best=best, best_us=grid[best])
        out[f"M={m}"] = row
        line = (f"{k:6d}x{n:<6d} M={m:3d} default {row['default_cold_us']:6.1f} / {row['default_hot_us']:6.1f} us"
                f"  invariant {row['invariant_cold_us']:6.1f} / {row['invariant_hot_us']:6.1f} us (cold / hot)"
                f"  mma.sync {row['mma_sync_cold_us']:6.1f} wgmma {row['wgmma_cold_us']:6.1f} (split {rule})")
        if sweep:
            by_split = {s: min(v for c, v in row["sweep_cold_us"].items() if c.startswith(f"s{s} "))
                        for s in (splits or [rule])}
            line += f"  best {row['best']} {row['best_us']:6.1f}  per split " + " ".join(
                f"{s}:{v:.1f}" for s, v in by_split.items())
        print(line, flush=True)
    del ws
    torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="smollm2,llama8b")
    ap.add_argument("--m", default="1,16,64")
    ap.add_argument("--sweep", action="store_true", help="every output tile of the mma.sync family")
    ap.add_argument("--splits", default="rule", help="K splits the sweep takes: 'rule' or e.g. 1,2,4,8")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    ms = [int(v) for v in args.m.split(",")]
    splits = [] if args.splits == "rule" else [int(v) for v in args.splits.split(",")]
    result = {**run_header(), "num_sms": num_sms(torch.device("cuda")), "shapes": {}}
    for model in args.models.split(","):
        hf = SMOLLM2_HF if model == "smollm2" else LLAMA8B_HF
        for name, (k, n) in shapes(hf).items():
            sweep = args.sweep and name != "lm_head"
            result["shapes"][f"{model} {name} {k}x{n}"] = bench_shape(k, n, ms, sweep, splits)
    if args.out:
        write_result(args.out, result)


if __name__ == "__main__":
    main()
