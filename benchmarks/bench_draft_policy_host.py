"""Host cost of the draft-length policy's two per-step calls (one C++ pass each, csrc/core/draft_policy.h)
against their NumPy forms before the port, kept as the references in tests/test_draft_policy_observe.py
and tests/test_draft_policy_plan.py: microseconds per call at 1 / 16 / 64 rows on graph-replayed steps,
every row planned 4 drafts and having verified 2 and accepted 1. CPU only, no model.

    python benchmarks/bench_draft_policy_host.py
"""
from __future__ import annotations

import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pyengine.spec_decode.draft_length import DraftLengthPolicy  # noqa: E402
from tests.test_draft_policy_observe import reference_observe_rows  # noqa: E402
from tests.test_draft_policy_plan import ReferencePolicy  # noqa: E402


def per_call_us(rows: int, k: int, part: str, use_reference: bool, calls: int = 2000) -> float:
    """part: 'plan' (draft_lengths) or 'observe' (observe_rows)."""
    kind = ReferencePolicy if use_reference and part == "plan" else DraftLengthPolicy
    table = np.linspace(1.0, 1.1, k + 1)  # the engine's table lookup is a few us; np.linspace is ~20
    policy = kind(k, graph_costs=lambda r: table, step_cost=(1.0, 0.02))
    slots = np.arange(rows, dtype=np.int64)
    ids = slots + 100
    drafts, committed = np.full(rows, 2, np.int32), np.full(rows, 2, np.int32)
    for _ in range(6):  # past the warm-up plans
        policy.draft_lengths(slots, ids)
        policy.observe_rows(slots, drafts, committed)

    def step() -> float:
        start = time.perf_counter()
        if part == "plan":
            policy.draft_lengths(slots, ids)
        elif use_reference:
            reference_observe_rows(policy, slots, drafts, committed)
        else:
            policy.observe_rows(slots, drafts, committed)
        seconds = time.perf_counter() - start
        if part == "plan":
            policy.observe_rows(slots, drafts, committed)  # the next plan is made afresh
        else:
            policy.planned[:] = 2
            policy._planned_any = True
        return seconds

    for _ in range(200):
        step()
    return sum(step() for _ in range(calls)) / calls * 1e6


def main() -> None:
    for part, name in (("plan", "draft_lengths"), ("observe", "observe_rows")):
        for rows in (1, 16, 64):
            cpp, ref = per_call_us(rows, 4, part, False), per_call_us(rows, 4, part, True)
            print(f"rows {rows:3d}: {name} {cpp:6.1f} us, NumPy form {ref:6.1f} us")


if __name__ == "__main__":
    main()
