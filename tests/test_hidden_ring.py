"""HiddenRing (spec_decode/hidden_ring.py): what keep() stores, gather() returns - through the slice
copies of a step with few requests and the indexed copy of one with many, wrapping round a row."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pyengine.spec_decode.hidden_ring import HiddenRing


def kept_then_gathered(slice_rows: int, requests: int, steps: int, size: int = 8) -> dict[tuple[int, int], torch.Tensor]:
    """Each step every request defers 1..3 positions (its step rows in one hidden tensor); at the
    end, every held (request, position)'s state from gather()."""
    rng = np.random.default_rng(requests * 100 + steps)
    ring = HiddenRing(size, torch.device("cpu"))
    ring.SLICE_ROWS = slice_rows
    ids = np.arange(requests, dtype=np.int64) + 40
    first = np.zeros(requests, dtype=np.int64)
    lo = first.copy()
    expected: dict[tuple[int, int], torch.Tensor] = {}
    for _ in range(steps):
        counts = rng.integers(1, 4, requests)
        rows = np.cumsum(counts) - counts
        hidden = torch.from_numpy(rng.standard_normal((int(counts.sum()), 5)))
        end = first + counts
        held_lo = np.maximum(lo, end - size)  # what still fits the ring
        ring.keep(ids, held_lo, first, end, rows, hidden)
        expected.update({(int(s), int(f + t)): hidden[int(r + t)] for s, f, r, c in zip(ids, first, rows, counts)
                         for t in range(int(c))})
        lo, first = held_lo, end
    out = {}
    for s, a, b in zip(ids.tolist(), lo.tolist(), first.tolist()):
        pos = np.arange(a, b)
        got = ring.gather(np.full(len(pos), s), pos)
        out.update(((s, int(p)), g) for p, g in zip(pos, got))
    for key, value in out.items():  # every held position, older steps' too (wrapped round the row)
        assert torch.equal(value, expected[key]), key
    return out


@pytest.mark.parametrize("requests", [1, 2, 5])
def test_slice_and_indexed_copies_hold_the_same_states(requests: int) -> None:
    sliced = kept_then_gathered(slice_rows=8, requests=requests, steps=7)
    indexed = kept_then_gathered(slice_rows=0, requests=requests, steps=7)
    assert sliced.keys() == indexed.keys() and len(sliced) >= requests * 5
    assert all(torch.equal(sliced[k], indexed[k]) for k in sliced)
