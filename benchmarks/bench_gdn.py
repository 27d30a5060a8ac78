"""Gated DeltaNet decode / verify kernel (hipkernels/ssm/gated_delta_rule.hip) on the GPU at
Qwen3-Next's widths (16 key heads, 32 value heads, K = V = 128, bf16 inputs, fp32 state): time per
call (CUDA-graph timing) and bandwidth against the device copy bandwidth of the same run; and a
verify step of q tokens against a one-token step.

Each step reads one state (the base) and writes one (the state after its token 0), replays the
previous step's accepted records and writes a record per later token (pyengine/ops/reference/gdn.py).
bytes = state read + state written + records read (replayed) and written (q - 1) + the step's inputs
and outputs; a record is (K + 32 + 1) floats per 32-row tile and value head. Rows: a plain decode step
(q = 1, nothing replayed: the baseline of vs_one_token), a decode step right after an accepted run
and verify steps of q = 2..5 tokens, each replaying --replayed records (default 2: the previous step
accepted 2 drafts).

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
RECORD_ROWS = 32
SLOTS = 5  # 1 + k slots per request, k = 4


def case(batch: int, q_len: int, replayed: int) -> tuple[float, dict]:
    """(ms per call, bytes moved by kind) for `batch` rows of q_len tokens, each replaying `replayed`
    records of its previous step (num_accepted = 1 + replayed)."""
    ntok = batch * q_len
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(ntok, H, DK, device="cuda", generator=gen).bfloat16()
    kk = torch.randn(ntok, H, DK, device="cuda", generator=gen).bfloat16()
    v = torch.randn(ntok, HV, DV, device="cuda", generator=gen).bfloat16()
    g = -torch.rand(ntok, HV, device="cuda", generator=gen)
    beta = torch.rand(ntok, HV, device="cuda", generator=gen)
    state = torch.randn(batch * SLOTS, HV, DV, DK, device="cuda", generator=gen) * 0.1
    idx = torch.arange(batch * SLOTS, dtype=torch.int32, device="cuda").view(batch, SLOTS)
    acc = torch.full((batch,), 1 + replayed, dtype=torch.int32, device="cuda")
    qsl = torch.arange(0, ntok + 1, q_len, dtype=torch.int32, device="cuda")
    ms = time_ms_graph(lambda: cuda_ops.gated_delta_rule_update(q, kk, v, g, beta, state, qsl, idx, acc))
    state_bytes = HV * DV * DK * 4
    record_bytes = HV * -(-DV // RECORD_ROWS) * (DK + RECORD_ROWS + 1) * 4
    nbytes = {"state": batch * 2 * state_bytes, "records": batch * (replayed + q_len - 1) * record_bytes,
              "io": ntok * (2 * H * DK + 2 * HV * DV) * 2 + ntok * HV * 8}  # q, k, v, out (bf16), g, beta (fp32)
    return ms, nbytes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,4,16,64,128,256")
    ap.add_argument("--q-lens", default="1,2,3,4,5")
    ap.add_argument("--replayed", type=int, default=2, help="records each step replays (num_accepted - 1)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    copy = copy_bandwidth_gbps()
    result = dict(run_header(), copy_bandwidth_gbps=copy, replayed=args.replayed,
                  shape=dict(key_heads=H, value_heads=HV, key_dim=DK, value_dim=DV, slots_per_row=SLOTS), rows=[])
    plan = [(1, 0)] + [(q, args.replayed) for q in (int(x) for x in args.q_lens.split(","))]
    for batch in [int(b) for b in args.batches.split(",")]:
        one_ms = None
        for q_len, replayed in plan:
            ms, nbytes = case(batch, q_len, replayed)
            one_ms = ms if one_ms is None else one_ms  # the plain decode step
            total = sum(nbytes.values())
            row = {"batch": batch, "q_len": q_len, "replayed": replayed, "us": round(ms * 1e3, 2), "bytes": total,
                   "record_bytes": nbytes["records"], "of_copy": round(total / (ms * 1e-3) / (copy * 1e9), 3),
                   "vs_one_token": round(ms / one_ms, 3)}
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        write_result(args.out, result)


if __name__ == "__main__":
    main()
