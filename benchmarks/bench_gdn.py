"""Gated DeltaNet decode / verify kernel (hipkernels/ssm/gated_delta_rule.hip) on the GPU at
Qwen3-Next's widths (16 key heads, 32 value heads, K = V = 128, bf16 inputs, fp32 state): time per
call (CUDA-graph timing) and bandwidth = state bytes read (one state per row and head) + written
(one state per token) / time, against the device copy bandwidth of the same run; and a verify
step of q tokens against a one-token step.

    python3 benchmarks/bench_gdn.py --out benchmarks/results/gdn_h100.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.gpu_timing import copy_bandwidth_gbps, run_header, time_ms_graph, write_result  # noqa: E402
from pyengine.ops import cuda as cuda_ops  # noqa: E402

H, HV, DK, DV = 16, 32, 128, 128


def case(batch: int, q_len: int, k: int = 4) -> tuple[float, int]:
    """(ms per call, bytes the call must move) for `batch` rows of q_len tokens each."""
    ntok = batch * q_len
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(ntok, H, DK, device="cuda", generator=gen).bfloat16()
    kk = torch.randn(ntok, H, DK, device="cuda", generator=gen).bfloat16()
    v = torch.randn(ntok, HV, DV, device="cuda", generator=gen).bfloat16()
    g = -torch.rand(ntok, HV, device="cuda", generator=gen)
    beta = torch.rand(ntok, HV, device="cuda", generator=gen)
    state = torch.randn(batch * (1 + k), HV, DV, DK, device="cuda", generator=gen)
    idx = torch.arange(batch * (1 + k), dtype=torch.int32, device="cuda").view(batch, 1 + k)
    acc = torch.full((batch,), 2, dtype=torch.int32, device="cuda")
    qsl = torch.arange(0, ntok + 1, q_len, dtype=torch.int32, device="cuda")
    ms = time_ms_graph(lambda: cuda_ops.gated_delta_rule_update(q, kk, v, g, beta, state, qsl, idx, acc))
    state_bytes = HV * DV * DK * 4
    io = ntok * (2 * H * DK + 2 * HV * DV) * 2 + ntok * HV * 8  # q, k, v, out (bf16), g, beta (fp32)
    return ms, batch * state_bytes * (1 + q_len) + io


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,4,16,64,128,256")
    ap.add_argument("--q-lens", default="1,2,3,4,5")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    copy = copy_bandwidth_gbps()
    result = dict(run_header(), copy_bandwidth_gbps=copy, shape=dict(key_heads=H, value_heads=HV, key_dim=DK,
                                                                      value_dim=DV), rows=[])
    for batch in [int(b) for b in args.batches.split(",")]:
        one_ms = None
        for q_len in [int(x) for x in args.q_lens.split(",")]:
            ms, nbytes = case(batch, q_len)
            one_ms = ms if q_len == 1 else one_ms
            row = {"batch": batch, "q_len": q_len, "us": round(ms * 1e3, 2), "bytes": nbytes,
                   "of_copy": round(nbytes / (ms * 1e-3) / (copy * 1e9), 3),
                   "vs_one_token": round(ms / one_ms, 3) if one_ms else None}
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        write_result(args.out, result)


if __name__ == "__main__":
    main()
