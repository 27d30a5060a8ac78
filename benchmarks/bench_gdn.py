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

--l2 (default cold): cold is what a model step sees: each of Qwen3-Next's 36 GDN layers reads its
own state, written one step earlier, from device memory. The timed graph calls the kernel once per
state pool over enough distinct pools (each with its own slots) that the state traffic between two
uses of one pool is at least twice the L2 (the pool count is in each row). hot replays the same
call on one pool (the old figures): at batch <= 16 the whole state then sits in the 50 MB L2 of an
H100. q, k, v, g and beta are shared by the pools in both modes (a layer's inputs come from the
projection just before it). Both in one run: --l2 cold,hot.

--grid direct|persistent forces the kernel's grid (ops.cuda.gdn.force_grid; default: the kernel's choice).

--once launches each case once, eagerly, untimed (for a profiler): with --batches 1 --q-lens 5 the
second launch is the verify step, so `ncu -k regex:gated_delta_rule_kernel --launch-skip 1
--launch-count 1 python3 benchmarks/bench_gdn.py --batches 1 --q-lens 5 --once` profiles it (its
state is the first of the cold pools, written before the others: out of L2 as far as the pools go).

    python3 benchmarks/bench_gdn.py --l2 cold,hot --out benchmarks/results/gdn_h100.json
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.gpu_timing import copy_bandwidth_gbps, graph_ms, run_header, time_ms_graph, write_result  # noqa: E402
from pyengine.ops import cuda as cuda_ops  # noqa: E402
from pyengine.ops.cuda import gdn as cuda_gdn  # noqa: E402

H, HV, DK, DV = 16, 32, 128, 128
RECORD_ROWS = 32
SLOTS = 5  # 1 + k slots per request, k = 4
MAX_POOLS = 128


def l2_bytes() -> int:
    return int(getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20))


def case(batch: int, q_len: int, replayed: int, l2: str, once: bool = False) -> tuple[float, dict, int]:
    """(ms per call, bytes moved by kind, state pools rotated) for `batch` rows of q_len tokens, each
    replaying `replayed` records of its previous step (num_accepted = 1 + replayed). once: one eager
    call on the first pool, untimed (0 ms)."""
    ntok = batch * q_len
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(ntok, H, DK, device="cuda", generator=gen).bfloat16()
    kk = torch.randn(ntok, H, DK, device="cuda", generator=gen).bfloat16()
    v = torch.randn(ntok, HV, DV, device="cuda", generator=gen).bfloat16()
    g = -torch.rand(ntok, HV, device="cuda", generator=gen)
    beta = torch.rand(ntok, HV, device="cuda", generator=gen)
    idx = torch.arange(batch * SLOTS, dtype=torch.int32, device="cuda").view(batch, SLOTS)
    acc = torch.full((batch,), 1 + replayed, dtype=torch.int32, device="cuda")
    qsl = torch.arange(0, ntok + 1, q_len, dtype=torch.int32, device="cuda")
    state_bytes = HV * DV * DK * 4
    record_bytes = HV * -(-DV // RECORD_ROWS) * (DK + RECORD_ROWS + 1) * 4
    nbytes = {"state": batch * 2 * state_bytes, "records": batch * (replayed + q_len - 1) * record_bytes,
              "io": ntok * (2 * H * DK + 2 * HV * DV) * 2 + ntok * HV * 8}  # q, k, v, out (bf16), g, beta (fp32)
    touched = nbytes["state"] // 2 + nbytes["records"]  # state lines a call reads or writes
    pools = 1 if l2 == "hot" else min(MAX_POOLS, max(2, 1 + math.ceil(2 * l2_bytes() / touched)))
    states = [torch.randn(batch * SLOTS, HV, DV, DK, device="cuda", generator=gen) * 0.1 for _ in range(pools)]

    def call(state: torch.Tensor) -> Callable[[], object]:
        return lambda: cuda_ops.gated_delta_rule_update(q, kk, v, g, beta, state, qsl, idx, acc)

    if once:
        call(states[0])()
        torch.cuda.synchronize()
        return 0.0, nbytes, pools
    ms = time_ms_graph(call(states[0])) if l2 == "hot" else graph_ms([call(s) for s in states])
    del states
    return ms, nbytes, pools


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,4,16,64,128,256")
    ap.add_argument("--q-lens", default="1,2,3,4,5")
    ap.add_argument("--replayed", type=int, default=2, help="records each step replays (num_accepted - 1)")
    ap.add_argument("--l2", default="cold", help="cold: state pools rotated past the L2; hot: one pool; both: cold,hot")
    ap.add_argument("--grid", choices=["auto", "direct", "persistent"], default="auto")
    ap.add_argument("--once", action="store_true", help="each case launched once, untimed (profilers)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.grid != "auto":
        cuda_gdn.force_grid = args.grid
    plan = [(1, 0)] + [(q, args.replayed) for q in (int(x) for x in args.q_lens.split(","))]
    if args.once:
        for l2 in args.l2.split(","):
            for batch in [int(b) for b in args.batches.split(",")]:
                for q_len, replayed in plan:
                    case(batch, q_len, replayed, l2, once=True)
                    print(f"launched l2={l2} batch={batch} q_len={q_len} replayed={replayed}", flush=True)
        return
    copy = copy_bandwidth_gbps()
    modes = args.l2.split(",")
    result = dict(run_header(), copy_bandwidth_gbps=copy, l2_bytes=l2_bytes(), replayed=args.replayed, grid=args.grid,
                  shape=dict(key_heads=H, value_heads=HV, key_dim=DK, value_dim=DV, slots_per_row=SLOTS), rows=[])
    table = []
    for l2 in modes:
        for batch in [int(b) for b in args.batches.split(",")]:
            one_ms = None
            for q_len, replayed in plan:
                ms, nbytes, pools = case(batch, q_len, replayed, l2)
                one_ms = ms if one_ms is None else one_ms  # the plain decode step
                total = sum(nbytes.values())
                row = {"l2": l2, "pools": pools, "batch": batch, "q_len": q_len, "replayed": replayed,
                       "us": round(ms * 1e3, 2), "bytes": total, "record_bytes": nbytes["records"],
                       "of_copy": round(total / (ms * 1e-3) / (copy * 1e9), 3), "vs_one_token": round(ms / one_ms, 3)}
                result["rows"].append(row)
                print(json.dumps(row), flush=True)
            last = result["rows"][-len(plan):]
            table.append(f"{l2:4} b={batch:<4} " + " ".join(f"q{r['q_len']}r{r['replayed']}:{r['us']}us/"
                                                          f"{r['of_copy']}/{r['vs_one_token']}x" for r in last))
    print("\n".join(table))
    if args.out:
        write_result(args.out, result)


if __name__ == "__main__":
    main()
