"""The wgmma family's 128 x 256 and 128 x 192 tiles (hipkernels/gemm/invariant_gemm_wgmma_wide.hip)
against its 128-wide tiles and cuBLAS, at Llama-8B's projection shapes and prefill-size M (issue
18: the 4k prefill's GEMMs). Kernels' own time in a CUDA graph (time_ms_graph), bf16, one weight
(hot).

Columns: cuBLAS (torch.mm), the invariant default (what LLM(batch_invariant=True) runs), the wgmma
family forced to 128-, 192- and 256-wide tiles (InvariantGemmParams.family 2, tile_n; 256 for
split-1 shapes only: that tile takes one K range). Every column but cuBLAS gives a shape the same
bits (tests/test_invariant_gemm_gpu.py).

    python3 benchmarks/bench_gemm_wide_tiles.py [--m 64,128,256,512,4096] [--out PATH]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from gpu_timing import run_header, time_ms_graph, write_result  # noqa: E402

from pyengine.ops import cuda as cuda_ops  # noqa: E402
from pyengine.ops.cuda.launch import kernels, num_sms, params, row_stride, stream  # noqa: E402

# (K, N) of Llama-8B: qkv, o, gate_up, down, lm_head
SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096),
          "lm_head": (4096, 128256)}


def wgmma_gemm(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, tile_n: int) -> None:
    """The wgmma family with its tile width forced (128, 192 or 256), the shape's default split."""
    p = params(kernels.InvariantGemmParams, x=x.data_ptr(), w=w.data_ptr(), y=y.data_ptr(), m=x.shape[0],
               n=w.shape[1], k=x.shape[1], x_stride=row_stride(x), y_stride=row_stride(y), dtype=1,
               num_sms=num_sms(x.device), family=2, tile_n=tile_n)
    rc = kernels.invariant_gemm(p, stream(x.device))
    if rc not in (None, 0):
        raise RuntimeError(f"invariant_gemm returned {rc}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", default="64,128,256,512,4096")
    ap.add_argument("--out", default="benchmarks/results/batch_invariant_gemm_tiles_h100.json")
    args = ap.parse_args()
    sms = num_sms(torch.device("cuda"))
    result = run_header() | {"num_sms": sms, "shapes": {}}
    for name, (k, n) in SHAPES.items():
        w = (torch.randn(k, n, device="cuda") / k ** 0.5).bfloat16()
        split = kernels.invariant_gemm_split(k, n, sms)
        for m in [int(v) for v in args.m.split(",")]:
            x = torch.randn(m, k, device="cuda").bfloat16()
            y = torch.empty(m, n, dtype=x.dtype, device="cuda")
            t = {"cublas": time_ms_graph(lambda: torch.mm(x, w)),
                 "invariant": time_ms_graph(lambda: cuda_ops.invariant_gemm(x, w)),
                 "wgmma_128": time_ms_graph(lambda: wgmma_gemm(x, w, y, 128)),
                 "wgmma_192": time_ms_graph(lambda: wgmma_gemm(x, w, y, 192))}
            if split == 1:
                t["wgmma_256"] = time_ms_graph(lambda: wgmma_gemm(x, w, y, 256))
            row = {f"{key}_us": 1e3 * v for key, v in t.items()}
            row |= {f"{key}_tflops": 2 * m * k * n / v / 1e9 for key, v in t.items()}
            row["split"] = split
            result["shapes"][f"{name} {k}x{n} M={m}"] = row
            print(f"{name:8s} M={m:5d} split {split}  " + "  ".join(
                f"{key} {1e3 * v:8.1f} us ({2 * m * k * n / v / 1e9:4.0f} TF/s)" for key, v in t.items()), flush=True)
        w = None  # freed before the next shape
    write_result(args.out, result)


if __name__ == "__main__":
    main()
