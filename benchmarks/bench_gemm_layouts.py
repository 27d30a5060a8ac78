"""The Llama-3-8B projection GEMMs at decode batch sizes: weight layout x cuBLAS setting, timed
inside CUDA graphs (as a captured decode step runs them), as a fraction of the copy bandwidth
measured in the same run.

Layouts: x @ W with W stored [in, out] (torch.mm: cuBLAS "NN") and F.linear(x, W) with W stored
[out, in] (cuBLAS "TN"). Settings: PyTorch's defaults, cuBLASLt as the preferred BLAS backend, and
bf16 reduced-precision reductions disallowed (both can change the split-K choice and with it the
extra reduce kernel). The kernels one call launches are listed too (split-K shows as a second one).

Every timed call reads a different copy of the weight, cycling through enough copies to exceed the
50 MB L2 several times over: a decode step never re-reads a layer's weight, so an L2-resident
o_proj (33.5 MB) would overstate its bandwidth.

    python3 benchmarks/bench_gemm_layouts.py --out benchmarks/results/gemm_layouts_h100.json

H100, torch 2.11 (results/gemm_layouts_h100.json): [in, out] is as fast or faster everywhere except
qkv at M = 2..5 and 64; the two settings change nothing at batch 1 (cuBLASLt is slower on qkv). What
removes the split-K reduce is a zero cuBLAS workspace, CUBLAS_WORKSPACE_CONFIG=:0:0, read at the
first cuBLAS call (results/gemm_layouts_h100_cublas_ws0.json; with it, preferring cuBLASLt fails:
"OOM trying to allocate workspace for cublaslt", so run only "default" then).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_timing import copy_bandwidth_gbps, graph_ms, write_result, run_header  # noqa: E402

# name: (in, out) of the fused 8B projections (qkv = 32 + 2 * 8 heads of 128).
SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096),
          "lm_head": (4096, 128256)}
LAYOUTS = ("mm_in_out", "linear_out_in")
SETTINGS = ("default", "cublaslt", "no_bf16_reduced_reduction")
STREAM_BYTES = 256 << 20  # weight bytes cycled through per shape: ~5x the H100's L2


def streamed_weight(k: int, n: int, gen: torch.Generator) -> tuple[torch.Tensor, int, int]:
    """A random bf16 [k, n] weight, its bytes, and how many copies of it the timed calls cycle
    through (enough to exceed STREAM_BYTES, so that no call finds its weight in L2)."""
    nbytes = k * n * 2
    base = torch.empty(k, n, device="cuda", dtype=torch.bfloat16).normal_(0, 0.02, generator=gen)
    return base, nbytes, max(2, -(-STREAM_BYTES // nbytes))


@contextlib.contextmanager
def blas_setting(name: str) -> Iterator[None]:
    """Apply one of SETTINGS for the duration (process-global PyTorch flags, restored after)."""
    matmul = torch.backends.cuda.matmul
    prev_lib = torch.backends.cuda.preferred_blas_library()
    prev_red = matmul.allow_bf16_reduced_precision_reduction
    try:
        if name == "cublaslt":
            torch.backends.cuda.preferred_blas_library("cublaslt")
        elif name == "no_bf16_reduced_reduction":
            matmul.allow_bf16_reduced_precision_reduction = False
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(prev_lib)
        matmul.allow_bf16_reduced_precision_reduction = prev_red


def kernels_of(fn: Callable[[], object]) -> list[str]:
    """Names of the GPU kernels one eager fn() launches."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name[:90] for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def op(layout: str, x: torch.Tensor, w: torch.Tensor) -> Callable[[], torch.Tensor]:
    if layout == "mm_in_out":
        return lambda: torch.mm(x, w)
    return lambda: F.linear(x, w)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,2,5,16,64")
    ap.add_argument("--kernels-at", default="1,16", help="batches whose kernel names are listed")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--settings", default=",".join(SETTINGS))
    ap.add_argument("--out", default="benchmarks/results/gemm_layouts_h100.json")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    kernel_batches = {int(b) for b in args.kernels_at.split(",")}
    settings = args.settings.split(",")
    bw = copy_bandwidth_gbps()
    result: dict = {
        **run_header(),
        "copy_bandwidth_GBps": bw, "rows": [],
        # cuBLAS reads these once, at its first call: they bound the split-K workspace.
        "env": {v: os.environ.get(v) for v in ("CUBLAS_WORKSPACE_CONFIG", "CUBLASLT_WORKSPACE_SIZE")},
    }
    print(f"copy bandwidth {bw:.0f} GB/s", flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name in args.shapes.split(","):
        k, n = SHAPES[name]
        base, nbytes, copies = streamed_weight(k, n, gen)
        weights = {"mm_in_out": [base.clone() for _ in range(copies)],
                   "linear_out_in": [base.t().contiguous() for _ in range(copies)]}
        del base
        inner = max(copies, 16)
        for m in batches:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
            for layout in LAYOUTS:
                ws = weights[layout]
                for setting in settings:
                    with blas_setting(setting):
                        ms = graph_ms([op(layout, x, ws[i % copies]) for i in range(inner)])
                        kern = kernels_of(op(layout, x, ws[0])) if m in kernel_batches else None
                    row = {"matrix": name, "k": k, "n": n, "m": m, "layout": layout, "setting": setting,
                           "us": ms * 1e3, "GBps": nbytes / ms / 1e6, "fraction_of_copy": nbytes / ms / 1e6 / bw,
                           "kernels": kern}
                    result["rows"].append(row)
                    print(f"{name:8s} m={m:3d} {layout:14s} {setting:26s} {ms * 1e3:8.1f} us "
                          f"{row['fraction_of_copy']:.3f} of copy" + (f"  {kern}" if kern else ""), flush=True)
        del weights
        torch.cuda.empty_cache()
    write_result(args.out, result)


if __name__ == "__main__":
    main()
