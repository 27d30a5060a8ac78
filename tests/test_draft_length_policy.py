"""The draft-length policy proposes what pays, per request: full length when verify tokens are
nearly free and drafts are accepted, none for a request whose drafts are rejected or when verify
tokens cost real compute, and drafts again for a request whose acceptance recovers."""
from __future__ import annotations

from typing import Callable

import numpy as np

from pyengine.spec_decode.draft_length import DraftLengthPolicy

# accept(row, step) -> the chance that each draft of that row is accepted (given the earlier ones were)
Acceptance = Callable[[int, int], float]


def simulate(k: int, rows: int, accept: float | Acceptance, cost: tuple[float, float], steps: int = 200,
             found: float = 1.0, policy: DraftLengthPolicy | None = None) -> np.ndarray:
    """Drive the policy with a synthetic engine: step time a + b * tokens; each draft of row i is
    accepted with probability accept(i, step) given the previous ones were; the proposer finds
    drafts for a row with probability `found`. Returns the lengths chosen, [steps, rows]."""
    rng = np.random.default_rng(0)
    policy = policy or DraftLengthPolicy(k)
    rate: Acceptance = accept if callable(accept) else (lambda i, s: accept)
    a, b = cost
    slots = np.arange(rows)  # the scheduler's request slots
    seq_ids = slots + 100  # ids need not be dense
    chosen = np.zeros((steps, rows), dtype=np.int64)
    for step in range(steps):
        asked = policy.draft_lengths(slots, seq_ids)
        assert ((0 <= asked) & (asked <= k)).all()
        chosen[step] = asked
        drafts = np.where(rng.random(rows) < found, asked, 0)
        accepted = np.array([next((j for j in range(n) if rng.random() > rate(i, step)), n)
                             for i, n in enumerate(drafts)])
        policy.observe_rows(slots, drafts, accepted + 1)
        policy.observe_step(int(rows + drafts.sum()), a + b * (rows + drafts.sum()))
    return chosen


def mostly(chosen: np.ndarray, value: int) -> bool:
    return (chosen == value).mean() >= 0.9


BANDWIDTH_BOUND = (0.016, 0.0002)  # batch 1 on a CPU: a token more costs little
COMPUTE_BOUND = (0.001, 0.002)  # time proportional to tokens


def test_bandwidth_bound_and_accepted_drafts_use_full_length() -> None:
    assert mostly(simulate(k=4, rows=1, accept=0.8, cost=BANDWIDTH_BOUND)[-100:], 4)


def test_poor_acceptance_proposes_nothing() -> None:
    assert mostly(simulate(k=4, rows=1, accept=0.0, cost=BANDWIDTH_BOUND)[-100:], 0)


def test_compute_bound_batch_proposes_nothing_at_moderate_acceptance() -> None:
    # 32 rows, step time proportional to tokens: a draft is worth it only if accepted > 1/1
    assert mostly(simulate(k=4, rows=32, accept=0.4, cost=COMPUTE_BOUND)[-100:], 0)


def test_intermediate_cost_picks_an_intermediate_length() -> None:
    chosen = simulate(k=8, rows=8, accept=0.6, cost=(0.02, 0.0015))[-100:].ravel().tolist()
    best = max(set(chosen), key=chosen.count)
    assert 0 < best < 8, chosen


def test_rows_that_never_accept_get_no_drafts_while_accepting_rows_keep_theirs() -> None:
    # Half the rows always accept, half never: only the accepting half speculates, at full length,
    # both where verify tokens are nearly free and where they cost compute.
    for rows, cost in ((8, BANDWIDTH_BOUND), (32, (0.01, 0.001))):
        chosen = simulate(k=4, rows=rows, accept=lambda i, s: 1.0 if i % 2 == 0 else 0.0, cost=cost)[-100:]
        assert mostly(chosen[:, 0::2], 4), (rows, chosen[:, 0::2].mean())
        assert mostly(chosen[:, 1::2], 0), (rows, chosen[:, 1::2].mean())


def test_a_row_whose_acceptance_recovers_gets_drafts_back() -> None:
    # Row 0 rejects everything for 150 steps, then accepts everything; row 1 always accepts.
    def accept(i: int, step: int) -> float:
        return 1.0 if i == 1 or step >= 150 else 0.0

    chosen = simulate(k=4, rows=2, accept=accept, cost=BANDWIDTH_BOUND, steps=400)
    assert mostly(chosen[100:150, 0], 0), chosen[100:150, 0]
    assert mostly(chosen[100:, 1], 4)
    assert mostly(chosen[-100:, 0], 4), chosen[150:, 0]  # back at full length, probes included


def test_recovery_in_a_compute_bound_batch_is_cheap_and_complete() -> None:
    # 16 rows, verify tokens cost compute: while no row accepts, probes add well under one token
    # per step; once every draft is accepted all rows return to full length.
    def accept(i: int, step: int) -> float:
        return 0.0 if step < 200 else 1.0

    chosen = simulate(k=4, rows=16, accept=accept, cost=(0.01, 0.001), steps=1200)
    assert chosen[100:200].sum(axis=1).mean() < 0.5, chosen[100:200].sum(axis=1)
    assert mostly(chosen[-100:], 4), chosen[-100:].mean()


def test_rows_without_proposals_do_not_stop_the_others() -> None:
    # The proposer finds drafts for a row only a third of the time: the drafts it does find are
    # accepted, so asking stays worthwhile (a miss costs nothing).
    assert mostly(simulate(k=4, rows=4, accept=0.9, cost=BANDWIDTH_BOUND, found=0.3)[-100:], 4)


def test_a_slot_taken_by_a_new_request_starts_afresh() -> None:
    policy = DraftLengthPolicy(4)
    simulate(k=4, rows=2, accept=lambda i, s: 0.0 if i == 0 else 1.0, cost=BANDWIDTH_BOUND, steps=60, policy=policy)
    assert policy.row_acceptance(0)[0] < 0.1 < 0.9 < policy.row_acceptance(1)[0]
    # Requests 100 and 101 finished; 7 now holds slot 0: it starts at the batch's estimate.
    policy.draft_lengths(np.array([0, 1]), np.array([7, 101]))
    batch = (policy.pool_accepts / policy.pool_trials).cumprod()
    np.testing.assert_allclose(policy.row_acceptance(0), batch)
    assert policy.row_acceptance(1)[0] > 0.9, "the request that kept its slot kept its evidence"


def test_rows_that_cannot_finish_last_get_nothing() -> None:
    """The engine marks rows that finish before another row whatever happens: their drafts could
    not shorten the run, so they get none, while the others keep the full length (and no probe)."""
    policy = DraftLengthPolicy(4)
    simulate(k=4, rows=3, accept=1.0, cost=BANDWIDTH_BOUND, steps=30, policy=policy)
    slots, seq_ids = np.arange(3), np.arange(100, 103)
    assert policy.draft_lengths(slots, seq_ids).tolist() == [4, 4, 4]
    assert policy.draft_lengths(slots, seq_ids, np.array([True, False, True])).tolist() == [4, 0, 4]
    assert policy.probes[1] == -1
