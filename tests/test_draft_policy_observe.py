"""DraftLengthPolicy.observe_rows (one C++ pass, csrc/core/draft_policy.h) against its NumPy form
before the port, kept here as the reference: random plans and verify outcomes over many steps, with
graph costs and without, probes and warm-up included; every count must be bit-identical and the
plan-repeat state the same."""
from __future__ import annotations

import numpy as np
import pytest

from pyengine.spec_decode.draft_length import DraftLengthPolicy


def reference_observe_rows(self, slots: np.ndarray, num_drafts: np.ndarray, num_committed: np.ndarray) -> None:
    """The decode rows of a step (request slots): drafts verified and tokens committed per row
    (rows this step's plan asked nothing of are ignored)."""
    if not self._planned_any:  # the plan asked nothing of any row
        return
    slots = np.asarray(slots, dtype=np.int64)
    asked = np.nonzero(self.planned[slots] > 0)[0]
    if not len(asked):
        return
    rows = slots[asked]
    drafts = np.asarray(num_drafts)[asked]
    self.asked[rows] = self.decay * self.asked[rows] + 1.0
    unfilled_probes = rows[(self.probes[rows] >= 0) & (drafts == 0)]
    if self.graph_costs is not None and len(unfilled_probes):
        # graph steps: an unfilled probe is not repeated at once (another row's filled probe would
        # make the next step a padded verify step too): the row was asked, it waits an interval
        self.idle[unfilled_probes, self.probes[unfilled_probes]] = 0
    if not drafts.any():  # nothing was found: no evidence but that
        self.found[rows] *= self.decay
        repeat = self._unfilled if self.graph_costs is None or not len(unfilled_probes) else None
        self._quiet, self._unfilled = repeat or self._quiet, None
        return
    self._quiet = self._unfilled = None
    accepted = np.asarray(num_committed)[asked] - 1
    self.found[rows] = self.decay * self.found[rows] + (drafts > 0)
    cols = np.arange(self.k)
    verified = cols[None, :] < drafts[:, None]  # [rows, k]: position j verified
    tried = verified & (cols[None, :] <= accepted[:, None])  # ... after all earlier ones were accepted
    passed = cols[None, :] < accepted[:, None]
    # An accepted probe: the row's acceptance has changed, forget its evidence from there on.
    start = self.probes[rows]
    forget = (start >= 0) & (accepted > start)
    if forget.any():
        wipe = forget[:, None] & (cols[None, :] >= start[:, None])
        self.trials[rows] = np.where(wipe, 0.0, self.trials[rows])
        self.accepts[rows] = np.where(wipe, 0.0, self.accepts[rows])
    has = drafts > 0  # rows with evidence this step: their counts decay, at every position
    if has.any():
        seen = rows[has]
        self.trials[seen] = self.decay * self.trials[seen] + tried[has]
        self.accepts[seen] = self.decay * self.accepts[seen] + passed[has]
        self.pool_trials = self.decay * self.pool_trials + tried.sum(axis=0)
        self.pool_accepts = self.decay * self.pool_accepts + passed.sum(axis=0)
        self.idle[seen] = np.where(verified[has], 0, self.idle[seen])


def state(p: DraftLengthPolicy) -> list:
    return [p.trials, p.accepts, p.asked, p.found, p.idle, p.pool_trials, p.pool_accepts, p.planned, p.probes]


@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("k", [1, 4])
def test_observe_rows_equals_the_numpy_reference(graph: bool, k: int) -> None:
    rng = np.random.default_rng(11 + k + 2 * graph)
    costs = (lambda rows: np.linspace(1.0, 1.0 + 0.05 * k, k + 1)) if graph else None
    policies = [DraftLengthPolicy(k, probe_every=6, graph_costs=costs, step_cost=(1.0, 0.02)) for _ in range(2)]
    seq_ids = np.arange(6, dtype=np.int64)
    drafted = 0
    for step in range(400):
        if step % 50 == 0:  # requests come and go: slots change owners
            seq_ids = seq_ids + 10
        n = int(rng.integers(1, 7))
        slots = rng.choice(8, size=n, replace=False).astype(np.int64)
        ids = seq_ids[slots % len(seq_ids)] + slots
        lengths = [p.draft_lengths(slots, ids) for p in policies]
        assert np.array_equal(lengths[0], lengths[1])
        found = rng.random(n) < 0.7
        drafts = np.where(found, np.minimum(lengths[0], rng.integers(0, k + 1, n)), 0).astype(np.int32)
        committed = (1 + rng.integers(0, drafts + 1)).astype(np.int32)
        drafted += int(drafts.sum())
        policies[0].observe_rows(slots, drafts, committed)
        reference_observe_rows(policies[1], slots, drafts, committed)
        for a, b in zip(state(policies[0]), state(policies[1])):
            assert a.dtype == b.dtype and np.array_equal(a, b), step
        assert (policies[0]._quiet is None) == (policies[1]._quiet is None)
        assert (policies[0]._unfilled is None) == (policies[1]._unfilled is None)
    assert drafted > 100
