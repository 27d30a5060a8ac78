"""SeqColumns (spec_decode/seq_columns.py) against a dict of dicts: random sets, gets and drops of
seq ids, rows reused after a drop and never shared by two requests present."""
from __future__ import annotations

import numpy as np
import pytest

from pyengine.spec_decode.seq_columns import SeqColumns


@pytest.mark.parametrize("few", [0, 4, 1000])  # the dict lookups, the sorted arrays, both
def test_columns_behave_as_a_dict_per_request(few: int) -> None:
    rng = np.random.default_rng(few)
    cols, ref = SeqColumns(width=2, default=-1), {}
    cols.FEW = few
    for _ in range(300):
        ids = rng.choice(200, size=int(rng.integers(0, 40)), replace=False).astype(np.int64) + 10**9
        op = rng.integers(3)
        if op == 0:
            column, values = int(rng.integers(2)), rng.integers(-5, 10**6, len(ids))
            cols.set(ids, values, column)
            for s, v in zip(ids.tolist(), values.tolist()):
                ref.setdefault(s, [-1, -1])[column] = v
        elif op == 1:
            cols.drop(ids.tolist())
            for s in ids.tolist():
                ref.pop(s, None)
        for column in (0, 1):
            want = [ref.get(s, [-1, -1])[column] for s in ids.tolist()]
            assert cols.get(ids, column).tolist() == want
        rows = cols.rows(np.fromiter(ref, np.int64, len(ref)))
        assert len(cols) == len(ref) and (rows >= 0).all() and len(set(rows.tolist())) == len(rows)
        assert (rows < cols.capacity).all()


def test_a_dropped_row_goes_to_the_next_request() -> None:
    cols = SeqColumns()
    first = cols.rows(np.array([7, 8, 9]), create=True)
    cols.set(np.array([8]), 5)
    cols.drop([8])
    again = cols.rows(np.array([11]), create=True)
    assert again[0] == first[1] and cols.get(np.array([11, 8]))[0] == 0 and cols.get(np.array([8]))[0] == 0
    assert cols.rows(np.array([8, 12])).tolist() == [-1, -1]
    assert cols.get(np.zeros(0, np.int64)).shape == (0,)
