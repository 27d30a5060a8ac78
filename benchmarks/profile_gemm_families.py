"""Which invariant-GEMM family and tile a model's projection shapes want at each M (issue 18: where
invariant_gemm_wgmma_default_for switches SmolLM2's small weights from mma.sync to wgmma). For every
projection shape and M: cuBLAS (torch.mm), the invariant default (what LLM(batch_invariant=True)
runs), mma.sync forced (its default tile) and wgmma forced at 128-, 192- and (split 1) 256-wide
tiles. Every column but cuBLAS gives a shape the same bits (tests/test_invariant_gemm_gpu.py).
Microseconds per GEMM from CUDA-graph replays (time_ms_graph: one weight, hot; SmolLM2's weights
sit in L2 during a prefill too), bf16, PDL as the KernelConfig says.

    python3 benchmarks/profile_gemm_families.py [--models smollm2] [--m 64,256,1024,4096] [--out PATH]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_batch_invariant import shapes  # noqa: E402
from bench_decode import LLAMA8B_HF, SMOLLM2_HF  # noqa: E402
from gpu_timing import run_header, time_ms_graph, write_result  # noqa: E402

from pyengine.ops import cuda as cuda_ops  # noqa: E402
from pyengine.ops.cuda.launch import kernels, num_sms, params, row_stride, stream  # noqa: E402
from pyengine.ops.kernel_config import get_kernel_config  # noqa: E402


def forced(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, family: int, tile_n: int = 0) -> None:
    """The invariant GEMM with its family (1 mma.sync, 2 wgmma) and wgmma width forced."""
    p = params(kernels.InvariantGemmParams, x=x.data_ptr(), w=w.data_ptr(), y=y.data_ptr(), m=x.shape[0],
               n=w.shape[1], k=x.shape[1], x_stride=row_stride(x), y_stride=row_stride(y), dtype=1,
               num_sms=num_sms(x.device), family=family, tile_n=tile_n, pdl=get_kernel_config().pdl)
    rc = kernels.invariant_gemm(p, stream(x.device))
    if rc not in (None, 0):
        raise RuntimeError(f"invariant_gemm returned {rc}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="smollm2")
    ap.add_argument("--m", default="16,64,128,256,512,1024,2048,4096")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    sms = num_sms(torch.device("cuda"))
    result = run_header() | {"num_sms": sms, "shapes": {}}
    for model in args.models.split(","):
        for name, (k, n) in shapes(SMOLLM2_HF if model == "smollm2" else LLAMA8B_HF).items():
            w = (torch.randn(k, n, device="cuda") / k ** 0.5).bfloat16()
            split = kernels.invariant_gemm_split(k, n, sms)
            for m in [int(v) for v in args.m.split(",")]:
                x = torch.randn(m, k, device="cuda").bfloat16()
                y = torch.empty(m, n, dtype=x.dtype, device="cuda")
                t = {"cublas": time_ms_graph(lambda: torch.mm(x, w)),
                     "invariant": time_ms_graph(lambda: cuda_ops.invariant_gemm(x, w)),
                     "mma_sync": time_ms_graph(lambda: forced(x, w, y, 1)),
                     "wgmma_128": time_ms_graph(lambda: forced(x, w, y, 2, 128))}
                if m > 64:  # the wide tiles run above 64 rows only
                    t["wgmma_192"] = time_ms_graph(lambda: forced(x, w, y, 2, 192))
                    if split == 1:
                        t["wgmma_256"] = time_ms_graph(lambda: forced(x, w, y, 2, 256))
                row = {f"{key}_us": 1e3 * v for key, v in t.items()} | {"split": split}
                result["shapes"][f"{model} {name} {k}x{n} M={m}"] = row
                print(f"{model} {name:8s} M={m:5d} s{split} " + " ".join(
                    f"{key} {1e3 * v:7.1f}" for key, v in t.items()), flush=True)
            w = None  # freed before the next shape
    if args.out:
        write_result(args.out, result)


if __name__ == "__main__":
    main()
