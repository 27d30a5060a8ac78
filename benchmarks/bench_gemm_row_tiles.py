"""The batch-invariant GEMM (default family) at M = 16, 17, 32, 64 and 65 rows for SmolLM2's and
Llama-8B's weight shapes: where the mma.sync kernel's 16-row tiles stop and 64-row tiles start
(launch_rows in hipkernels/gemm/invariant_gemm_kernel.h), median of triton's do_bench (host launch
included), microseconds.

    python3 benchmarks/bench_gemm_row_tiles.py
"""
from __future__ import annotations

import os
import sys

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pyengine.ops import cuda as cuda_ops  # noqa: E402

SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576), (576, 49152), (4096, 6144), (14336, 4096)]


def main() -> None:
    for k, n in SHAPES:
        w = (torch.randn(k, n, device="cuda") / k ** 0.5).bfloat16()
        cells = []
        for m in (16, 17, 32, 64, 65):
            x = torch.randn(m, k, device="cuda").bfloat16()
            us = 1e3 * do_bench(lambda: cuda_ops.invariant_gemm(x, w, None), warmup=20, rep=100, return_mode="median")
            cells.append(f"M={m}: {us:.1f}us")
        print(k, n, " ".join(cells), flush=True)


if __name__ == "__main__":
    main()
