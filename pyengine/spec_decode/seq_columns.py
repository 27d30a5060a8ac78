"""Integer columns per request, read and written for a step's rows at once.

A drafting layer's proposer keeps a few integers per request (how far its layer has caught up, the
span of positions its ring holds). Kept in dicts, a step over 64 rows spent tens of microseconds in
per-row Python on each of them; here a step's lookup is one searchsorted over the requests present,
and a request's row stays its own until it is dropped, so rows index other per-request buffers too
(HiddenRing's).
"""
from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from pyengine.engine.host_arrays import index_of


class SeqColumns:
    """`width` int64 columns per seq id (`default` where never set); row r of `values` is the
    request rows() gives r, until drop() frees it for another."""

    FEW = 4  # up to this many seq ids a lookup goes through the dict

    def __init__(self, width: int = 1, default: int = 0) -> None:
        self.default = default
        self.values = np.full((16, width), default, dtype=np.int64)
        self._row: dict[int, int] = {}
        self._free: list[int] = []
        self._keys = np.zeros(0, dtype=np.int64)  # the seq ids present, sorted, and their rows
        self._key_rows = np.zeros(0, dtype=np.int64)

    def __len__(self) -> int:
        return len(self._row)

    @property
    def capacity(self) -> int:
        """Rows allocated: every row rows() returns is below it."""
        return self.values.shape[0]

    def rows(self, seq_ids: np.ndarray, create: bool = False) -> np.ndarray:
        """Each request's row, -1 for one never set (create: a new row for it, `default` values)."""
        seq_ids = np.asarray(seq_ids, dtype=np.int64)
        if len(seq_ids) <= self.FEW:  # dict lookups: numpy's per-call cost is the larger here
            out = np.fromiter((self._row.get(s, -1) for s in seq_ids.tolist()), np.int64, len(seq_ids))
            found = out >= 0
        else:
            at = index_of(self._keys, seq_ids, keys_sorted=True)
            found = at >= 0
            out = np.where(found, self._key_rows[at], -1) if len(self._keys) else at
        if create and not found.all():
            for i in np.flatnonzero(~found).tolist():
                sid = int(seq_ids[i])
                if sid not in self._row:  # a repeated new id takes one row
                    self._row[sid] = self._free.pop() if self._free else len(self._row)
                out[i] = self._row[sid]
            if out.max() >= self.capacity:
                grown = np.full((max(2 * self.capacity, int(out.max()) + 1), self.values.shape[1]), self.default,
                                dtype=np.int64)
                grown[:self.capacity] = self.values
                self.values = grown
            self._reindex()
        return out

    def get(self, seq_ids: np.ndarray, column: int = 0) -> np.ndarray:
        rows = self.rows(seq_ids)
        if len(rows) == 1:
            return np.array([self.values[rows[0], column] if rows[0] >= 0 else self.default], dtype=np.int64)
        return np.where(rows >= 0, self.values[np.maximum(rows, 0), column], self.default)

    def set(self, seq_ids: np.ndarray, values: np.ndarray | int, column: int = 0) -> None:
        if len(seq_ids):
            rows = self.rows(seq_ids, create=True)  # first: it may grow `values`
            self.values[rows, column] = values

    def drop(self, seq_ids: Iterable[int]) -> None:
        """These requests hold no row any more (their values back to `default`)."""
        dropped = [self._row.pop(int(s)) for s in seq_ids if int(s) in self._row]
        if dropped:
            self.values[dropped] = self.default
            self._free.extend(dropped)
            self._reindex()

    def _reindex(self) -> None:
        keys = np.fromiter(self._row.keys(), dtype=np.int64, count=len(self._row))
        rows = np.fromiter(self._row.values(), dtype=np.int64, count=len(self._row))
        order = np.argsort(keys)
        self._keys, self._key_rows = keys[order], rows[order]
