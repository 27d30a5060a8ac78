"""The draft-length policy proposes what pays: full length when verify tokens are nearly free and
drafts are accepted, none when acceptance is poor or verify tokens cost real compute."""
from __future__ import annotations

import numpy as np

from pyengine.speculative import DraftLengthPolicy


def simulate(k: int, rows: int, accept: float, cost: tuple[float, float], steps: int = 200) -> list[int]:
    """Drive the policy with a synthetic engine: step time a + b * tokens, each draft accepted
    with probability `accept` given the previous ones were. Returns the lengths chosen."""
    rng = np.random.default_rng(0)
    policy = DraftLengthPolicy(k)
    a, b = cost
    chosen = []
    for _ in range(steps):
        n = policy.num_drafts(rows)
        chosen.append(n)
        drafts = np.full(rows, n)
        accepted = np.array([next((j for j in range(n) if rng.random() > accept), n) for _ in range(rows)])
        if n:
            policy.observe_rows(drafts, accepted + 1)
        policy.observe_step(rows * (1 + n), a + b * rows * (1 + n))
    return chosen[-100:]


def mostly(chosen: list[int], value: int) -> bool:
    return sum(c == value for c in chosen) >= 0.9 * len(chosen)


def test_bandwidth_bound_and_accepted_drafts_use_full_length() -> None:
    assert mostly(simulate(k=4, rows=1, accept=0.8, cost=(0.016, 0.0002)), 4)


def test_poor_acceptance_proposes_nothing() -> None:
    assert mostly(simulate(k=4, rows=1, accept=0.0, cost=(0.016, 0.0002)), 0)


def test_compute_bound_batch_proposes_nothing_at_moderate_acceptance() -> None:
    # 32 rows, step time proportional to tokens: a draft is worth it only if accepted > 1/1
    assert mostly(simulate(k=4, rows=32, accept=0.4, cost=(0.001, 0.002)), 0)


def test_intermediate_cost_picks_an_intermediate_length() -> None:
    chosen = simulate(k=8, rows=8, accept=0.6, cost=(0.02, 0.0015))
    best = max(set(chosen), key=chosen.count)
    assert 0 < best < 8, chosen
