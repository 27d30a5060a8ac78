"""The target's hidden states of positions a drafting layer (an MTP layer, an EAGLE-3 head) has not
caught up on yet, per request (MtpProposer).

A catch-up feeds the layer the target's hidden state of every position the target computed, so that
the layer's KV cache holds them when it drafts. Run every step, that forward costs even the steps
whose rows draft nothing (a quiet draft-length policy). Instead, a row that drafts nothing keeps its
step's hidden states here and catches up, all at once, in the first step it drafts in. The layer
then computes the same entries, only later, for the positions the ring still holds (a longer quiet
spell either forces a catch-up or, by default, lets the oldest positions go: MtpProposer.slide).

Each request holds one row of `size` positions (position p at p % size), from its first deferral
until it is dropped, and the span [lo, hi) of positions held, contiguous up to the last step's.
"""
from __future__ import annotations

import numpy as np
import torch

from pyengine.engine.host_arrays import to_device
from pyengine.spec_decode.seq_columns import SeqColumns


class HiddenRing:
    SLICE_ROWS = 2  # up to this many requests a keep() copies slices, more take one indexed copy
    LO, HI = 0, 1  # the span's columns in `spans`

    def __init__(self, size: int, device: torch.device) -> None:
        self.size, self.device = size, device
        self.buf: torch.Tensor | None = None  # [rows, size, width], made (and grown) on demand
        # per request its row of buf (kept until drop: a request defers again and again) and the
        # span [lo, hi) of positions held (-1, -1: none)
        self.spans = SeqColumns(width=2, default=-1)

    def held_from(self, seq_ids: np.ndarray, first: np.ndarray) -> np.ndarray:
        """Per request, the first position whose hidden state is at hand in this step: its span's
        lo where the span reaches this step's first position, else first (the step's own states)."""
        if not len(self.spans):
            return first.copy()
        rows = self.spans.rows(seq_ids)
        span = self.spans.values[np.maximum(rows, 0)]
        reaches = (rows >= 0) & (span[:, self.HI] == first)
        return np.where(reaches, span[:, self.LO], first)

    def keep(self, seq_ids: np.ndarray, lo: np.ndarray, first: np.ndarray, end: np.ndarray,
             rows: np.ndarray, hidden: torch.Tensor) -> None:
        """Requests defer their catch-up: positions [first, end) of each are this step's hidden rows
        rows[i] + (p - first[i]); the span becomes [lo, end) (lo: held_from's answer)."""
        assert ((end - lo) <= self.size).all(), "a deferred catch-up must fit the ring"
        ring_rows = self.spans.rows(seq_ids, create=True)
        if self.buf is None or self.buf.shape[2] != hidden.shape[1]:
            self.buf = torch.zeros(self.spans.capacity, self.size, hidden.shape[1], dtype=hidden.dtype,
                                   device=self.device)
        if self.spans.capacity > self.buf.shape[0]:
            grow = torch.zeros(self.spans.capacity - self.buf.shape[0], self.size, self.buf.shape[2],
                               dtype=self.buf.dtype, device=self.device)
            self.buf = torch.cat([self.buf, grow])
        counts = end - first
        if len(seq_ids) <= self.SLICE_ROWS:  # a copy or two per request: no index arrays to stage
            for ring_row, f, c, src in zip(ring_rows.tolist(), first.tolist(), counts.tolist(), rows.tolist()):
                at = f % self.size
                head = min(c, self.size - at)  # the rest wraps to the row's start
                self.buf[ring_row, at:at + head].copy_(hidden[src:src + head])
                if c > head:
                    self.buf[ring_row, :c - head].copy_(hidden[src + head:src + c])
        else:
            which = np.repeat(np.arange(len(seq_ids)), counts)
            pos = first[which] + np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
            index = to_device(np.stack([ring_rows[which] * self.size + pos % self.size,
                                        rows[which] + pos - first[which]]), self.device)
            self.buf.view(-1, self.buf.shape[2]).index_copy_(0, index[0], hidden.index_select(0, index[1]))
        self.spans.values[ring_rows, self.LO] = lo
        self.spans.values[ring_rows, self.HI] = end

    def gather(self, seq_ids: np.ndarray, positions: np.ndarray) -> torch.Tensor:
        """The held hidden states of (request, position) pairs, [len(positions), width]."""
        assert self.buf is not None
        ring_rows = self.spans.rows(seq_ids)
        assert (ring_rows >= 0).all(), "a gathered request holds nothing"
        index = to_device(ring_rows * self.size + positions % self.size, self.device)
        return self.buf.view(-1, self.buf.shape[2]).index_select(0, index)

    def release(self, seq_ids) -> None:
        """These requests hold no positions any more (caught up); their rows stay theirs."""
        rows = self.spans.rows(np.asarray(seq_ids, dtype=np.int64))
        self.spans.values[rows[rows >= 0]] = -1

    def drop(self, seq_ids) -> None:
        """These requests are gone (finished or preempted): their rows go to others."""
        self.spans.drop(seq_ids)
