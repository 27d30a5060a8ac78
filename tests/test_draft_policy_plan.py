"""DraftLengthPolicy's plan (draft_lengths: the graph steps' padded lengths and every step's probes, one
C++ pass each, csrc/core/draft_policy.h) against its NumPy form before the port, kept here as the
reference: random batches, acceptance outcomes, cost tables and finish-last masks over many steps,
with graph costs and without; lengths, probes, idle counts and the plan-repeat state must be equal."""
from __future__ import annotations

import numpy as np
import pytest

from pyengine.spec_decode.draft_length import DraftLengthPolicy


class ReferencePolicy(DraftLengthPolicy):
    """The plan's two C++ parts as NumPy computed them before the port (the rest is shared)."""

    def _schedule_probes(self, rows: np.ndarray, eligible: np.ndarray, lengths: np.ndarray, interval: float,
                         graph_steps: bool, probe: int) -> float:
        can_grow = np.nonzero(eligible & (lengths < self.k))[0]
        idle = self.idle[rows[can_grow], lengths[can_grow]]
        stale = can_grow[idle >= interval]
        if graph_steps:
            if lengths.any() or (len(stale) and self.steps - self.last_probe_step >= interval):
                interval /= 2
                stale = can_grow[idle >= interval]
            else:
                stale = stale[:0]
            if len(stale):
                self.last_probe_step = self.steps
        self.probes[rows[stale]] = lengths[stale]
        lengths[stale] = np.minimum(lengths[stale] + probe, self.k)
        waiting = np.setdiff1d(can_grow, stale, assume_unique=True)
        idle_max = int(self.idle[rows[waiting], lengths[waiting]].max(initial=0))
        due = self.steps + interval - idle_max
        if graph_steps:
            due = max(due, self.last_probe_step + self.probe_every)
        return due

    def _padded_lengths(self, rows: np.ndarray, eligible: np.ndarray, cost: np.ndarray, closed: bool) -> np.ndarray:
        p = self.acceptance(rows) * eligible[:, None]
        h = self.found[rows] / self.asked[rows]
        if closed:
            gain = len(rows) * np.prod(h[eligible, None] * p[eligible], axis=0)
        else:
            gain = h @ p
        tokens = len(rows) + np.concatenate(([0.0], np.cumsum(gain)))
        found_any = 1.0 - float(np.prod(1.0 - h[eligible]))
        seconds = cost[:self.k + 1] * found_any + cost[0] * (1.0 - found_any)
        rate = tokens / seconds
        d = int(np.argmax(rate))
        if d == 0 or rate[d] <= (1.0 + self.margin) * rate[0]:
            return np.zeros(len(rows), dtype=np.int64)
        return np.where(eligible, d, 0)


def plan_state(p: DraftLengthPolicy) -> list:
    plans = [None if q is None else (q[0], q[1], q[2], float(q[3]), q[4]) for q in (p._quiet, p._unfilled)]
    return [p.trials, p.accepts, p.idle, p.planned, p.probes, p.pool_trials, p.last_probe_step, p.steps, plans]


def assert_same(a, b, step: int) -> None:
    if isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b), step
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), step
        for x, y in zip(a, b):
            assert_same(x, y, step)
    else:
        assert a == b, step


@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("k", [1, 4, 8])
def test_plan_equals_the_numpy_reference(graph: bool, k: int) -> None:
    rng = np.random.default_rng(3 * k + graph)
    # a few cost shapes per rows: cheap drafts (every row drafts), dear ones (none) and in between
    tables = {r: np.cumsum(np.concatenate(([1.0], rng.uniform(0.0, 0.4, k)))) for r in range(1, 9)}
    costs = (lambda rows: tables[rows]) if graph else None
    policy = DraftLengthPolicy(k, probe_every=6, graph_costs=costs, step_cost=(1.0, 0.05))
    reference = ReferencePolicy(k, probe_every=6, graph_costs=costs, step_cost=(1.0, 0.05))
    seq_ids = np.arange(8, dtype=np.int64)
    drafted = probed = 0
    for step in range(600):
        if step % 60 == 0:  # requests come and go: slots change owners
            seq_ids = seq_ids + 10
        n = int(rng.integers(1, 9))
        slots = rng.choice(8, size=n, replace=False).astype(np.int64) if step % 7 else np.arange(n, dtype=np.int64)
        ids = seq_ids[slots]
        last = None if step % 3 else rng.random(n) < 0.6
        got, want = policy.draft_lengths(slots, ids, last), reference.draft_lengths(slots, ids, last)
        assert got.dtype == want.dtype and np.array_equal(got, want), step
        assert_same(plan_state(policy), plan_state(reference), step)
        probed += int((policy.probes[slots] >= 0).sum())
        accept_rate = 0.9 if (step // 100) % 2 else 0.3  # acceptance moves: plans change
        found = rng.random(n) < 0.8
        drafts = np.where(found, got, 0).astype(np.int32)
        accepted = np.array([next((j for j in range(d) if rng.random() > accept_rate), d) for d in drafts])
        committed = (1 + accepted).astype(np.int32)
        drafted += int(drafts.sum())
        for p in (policy, reference):
            p.observe_rows(slots, drafts, committed)
    assert drafted > 100 and probed > 5


def test_plan_rejects_bad_arrays() -> None:
    policy = DraftLengthPolicy(2, graph_costs=lambda rows: np.array([1.0, 1.1, 1.2]), step_cost=(1.0, 0.05))
    for _ in range(6):
        policy.draft_lengths(np.arange(2), np.arange(2))
    policy.found = policy.found.astype(np.float32)  # the C++ pass views the arrays in place
    with pytest.raises(ValueError, match="array 3 has the wrong dtype"):
        policy.draft_lengths(np.arange(2), np.arange(2) + 5)
