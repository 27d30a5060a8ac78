"""Host cost of DraftLengthPolicy.observe_rows (one C++ pass, csrc/core/draft_policy.h) against its
NumPy form before the port (kept as the reference in tests/test_draft_policy_observe.py): microseconds
per call at 1 / 16 / 64 rows, every row having verified 2 drafts and accepted 1. CPU only, no model.

    python benchmarks/bench_policy_observe.py
"""
from __future__ import annotations

import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pyengine.spec_decode.draft_length import DraftLengthPolicy  # noqa: E402
from tests.test_draft_policy_observe import reference_observe_rows  # noqa: E402


def per_call_us(rows: int, k: int, use_reference: bool, calls: int = 2000) -> float:
    policy = DraftLengthPolicy(k, graph_costs=lambda r: np.linspace(1.0, 1.1, k + 1), step_cost=(1.0, 0.02))
    slots = np.arange(rows, dtype=np.int64)
    for _ in range(6):  # past the warm-up plans
        policy.draft_lengths(slots, slots + 100)
    drafts, committed = np.full(rows, 2, np.int32), np.full(rows, 2, np.int32)

    def observe() -> None:
        policy.planned[:] = 2
        policy._planned_any = True
        if use_reference:
            reference_observe_rows(policy, slots, drafts, committed)
        else:
            policy.observe_rows(slots, drafts, committed)

    for _ in range(200):
        observe()
    start = time.perf_counter()
    for _ in range(calls):
        observe()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    for rows in (1, 16, 64):
        cpp, ref = per_call_us(rows, 4, False), per_call_us(rows, 4, True)
        print(f"rows {rows:3d}: observe_rows {cpp:6.1f} us, NumPy form {ref:6.1f} us")


if __name__ == "__main__":
    main()
