"""Batch-invariant MLA decode attention against the size U of its fixed key ranges (the split rule
may depend on a row's own context; U is where batch 1's parallelism and batch 64's range ends
trade): DeepSeek-V3 MLA (128 heads, 576 / 512, block 64, bf16, CUDA-graph timing), batch 1 / 64 at
context 4096 and batch 1 / 8 at 16384, U = 512 (the default) .. 2048, one run.

    python3 benchmarks/bench_mla_range_size.py benchmarks/results/mla_range_size_sweep_h100.json
"""
from __future__ import annotations

import sys

import torch

from pyengine.ops import cuda as cuda_ops
from pyengine.ops.cuda import mla as cuda_mla
from pyengine.ops.kernel_config import KernelConfig, use_kernel_config
from bench_attention import make_meta  # noqa: E402  (benchmarks/ is on sys.path)
from gpu_timing import copy_bandwidth_gbps, time_ms_graph, write_result, run_header  # noqa: E402

RANGE_SIZES = (512, 640, 768, 1024, 2048)
POINTS = ((1, 4096), (64, 4096), (1, 16384), (8, 16384))


def main(out: str) -> None:
    gen = torch.Generator().manual_seed(0)
    bw = copy_bandwidth_gbps()
    hq, bs = 128, 64
    nblocks = max(b * c for b, c in POINTS) // bs + 1
    kv = torch.randn(nblocks, bs, 576, device="cuda", dtype=torch.bfloat16)
    default, rows = cuda_mla.SPLIT_BLOCK, []
    try:
        for batch, ctx in POINTS:
            meta = make_meta(batch, ctx, 1, bs, nblocks, gen)
            q = torch.randn(batch, hq, 576, device="cuda", dtype=torch.bfloat16)
            gbytes = batch * ctx * 576 * kv.element_size() / 1e9
            for size in RANGE_SIZES:
                cuda_mla.SPLIT_BLOCK = size
                with use_kernel_config(KernelConfig(batch_invariant=True)):
                    cuda_ops.paged_attention_mla(q, kv, meta, 192 ** -0.5)  # the step's workspace
                    ms = time_ms_graph(lambda: cuda_ops.paged_attention_mla(q, kv, meta, 192 ** -0.5))
                rows.append({"batch": batch, "context": ctx, "range_size": size, "invariant_ms": ms,
                             "fraction_of_copy": gbytes / (ms / 1e3) / bw})
                print(f"b={batch} ctx={ctx} U={size}: {ms:.4f} ms ({rows[-1]['fraction_of_copy']:.3f})", flush=True)
    finally:
        cuda_mla.SPLIT_BLOCK = default
    write_result(out, {**run_header(), "copy_bandwidth_GBps": bw, "rows": rows})


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results/mla_range_size_sweep_h100.json")
