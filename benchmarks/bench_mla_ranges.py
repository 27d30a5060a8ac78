"""MLA decode attention on fixed key ranges (hipkernels/attention/mla_ranges.h): the step chooses
which block computes a range (pyengine/ops/cuda/mla.py: one block per range + combine for decode and
verify rows, or every row walked by one block); both give the same bits. Times, in one run,
DeepSeek-V3 MLA (128 heads, 576 / 512, block 64, bf16, CUDA-graph timing) at each batch and context: the default
mode (per-row split rule), KernelConfig.batch_invariant (fixed ranges), and under it each assignment
forced (walk / split), and as a floor the walk over one range per row (one_range: no merges, not
the fixed ranges' bits); bandwidth = latent
bytes read (each row's context once) / time, against the device copy bandwidth of the same run.

    python3 benchmarks/bench_mla_ranges.py --out benchmarks/results/mla_ranges_h100.json
"""
from __future__ import annotations

import argparse

import torch

from pyengine.ops import cuda as cuda_ops
from pyengine.ops.cuda import mla as cuda_mla
from pyengine.ops.kernel_config import KernelConfig, use_kernel_config
from bench_attention import make_meta  # noqa: E402  (benchmarks/ is on sys.path)
from gpu_timing import copy_bandwidth_gbps, time_ms_graph, write_result, run_header  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/mla_ranges_h100.json")
    ap.add_argument("--batches", default="1,8,16,32,64")
    ap.add_argument("--contexts", default="512,4096,16384,32768")
    ap.add_argument("--max-tokens", type=int, default=2 << 20, help="skip points with batch*ctx above this")
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    copy_bw = copy_bandwidth_gbps()
    print(f"device-to-device copy: {copy_bw:.0f} GB/s", flush=True)
    hq, bs = 128, 64
    nblocks = args.max_tokens // bs + 1
    kv = torch.randn(nblocks, bs, 576, device="cuda", dtype=torch.bfloat16)
    rows = []
    split_block = cuda_mla.SPLIT_BLOCK

    def timed(meta, q, walk, invariant=False, unit=None) -> float:
        cuda_mla.force_walk = walk
        if unit is not None:
            cuda_mla.SPLIT_BLOCK = unit
        try:
            with use_kernel_config(KernelConfig(batch_invariant=invariant)):
                return time_ms_graph(lambda: cuda_ops.paged_attention_mla(q, kv, meta, 192 ** -0.5))
        finally:
            cuda_mla.force_walk = None
            cuda_mla.SPLIT_BLOCK = split_block

    points = [(b, c, 1) for b in map(int, args.batches.split(",")) for c in map(int, args.contexts.split(","))]
    points += [(64, 4096, q_len) for q_len in (2, 3, 5)]  # verify steps
    for batch, ctx, q_len in points:
        if batch * ctx > args.max_tokens:
            continue
        meta = make_meta(batch, ctx, q_len, bs, nblocks, gen)
        q = torch.randn(batch * q_len, hq, 576, device="cuda", dtype=torch.bfloat16)
        gbytes = batch * ctx * 576 * kv.element_size() / 1e9
        captured = True  # time_ms_graph falls back to eager timing when capture fails: record it
        cuda_ops.paged_attention_mla(q, kv, meta, 192 ** -0.5)  # the step's workspace, outside the capture
        try:
            with torch.cuda.graph(torch.cuda.CUDAGraph()):
                cuda_ops.paged_attention_mla(q, kv, meta, 192 ** -0.5)
        except RuntimeError:
            captured = False
        ms = {"default": timed(meta, q, None), "invariant": timed(meta, q, None, invariant=True),
              "walk": timed(meta, q, True, invariant=True), "split": timed(meta, q, False, invariant=True),
              "one_range": timed(meta, q, True, invariant=True, unit=-(-ctx // 64) * 64)}
        row = {"batch": batch, "context": ctx, "q_len": q_len, "graph_captured": captured,
               **{f"{k}_ms": v for k, v in ms.items()},
               **{f"{k}_fraction_of_copy": gbytes / (v / 1e3) / copy_bw for k, v in ms.items()}}
        rows.append(row)
        print(f"mla b={batch:3d} ctx={ctx:6d} q={q_len} graph={captured!s:5} " +
              " ".join(f"{k} {v:.4f} ms ({row[k + '_fraction_of_copy']:.2f})" for k, v in ms.items()), flush=True)
    write_result(args.out, {**run_header(), "copy_bandwidth_GBps": copy_bw,
                            "rows": rows})


if __name__ == "__main__":
    main()
