"""Drafts that stay on the device until the verify step is launched (MTP, EAGLE-3).

A model-based proposer's drafts are argmaxes (or samples) on the device. Reading them on the host
before schedule() waits for the whole draft chain, and the GPU then idles while the host schedules
and launches the verify step. Instead the proposer gives the scheduler placeholders (PLACEHOLDER,
the right count per row), and the drafts travel to the host behind the chain (one non-blocking
copy). The verify step's forward takes the true values on the device (token_patch: the runner
writes them over the placeholders of its staged input ids, on the stream after the chain), and
once the step is launched resolve() waits for the copy (by then the chain is done) and writes the
values into the scheduler's draft rows and the batch's input ids (Scheduler.fill_drafts), so that
verification, update() and outputs read the drafts as if they had been set on the host.

The forward computes on the same token ids either way: outputs are unchanged.
"""
from __future__ import annotations

import numpy as np
import torch

from pyengine.engine.host_arrays import index_of, to_device
from pyengine.ops import streams

PLACEHOLDER = -1  # an id no embedding holds: an input that missed its patch fails loudly on the CPU


class DeviceDrafts:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.seq_ids: np.ndarray | None = None  # rows with drafts on the device, this step
        self.counts = np.zeros(0, dtype=np.int64)
        self.values: torch.Tensor | None = None  # [sum counts] int64 on the device, row after row
        self.host: torch.Tensor | None = None  # their host copy (pinned on CUDA), valid after `copied`
        self.copied = torch.cuda.Event() if device.type == "cuda" else None  # recorded after the copy
        self._pinned: torch.Tensor | None = None  # reused host buffer
        self._order: tuple | None = None  # (batch, _batch_order(batch)) from patch_for, for resolve

    def clear(self) -> None:
        self.seq_ids, self.values, self.host, self._order = None, None, None, None

    def hold(self, seq_ids: np.ndarray, counts: np.ndarray, values: torch.Tensor) -> None:
        """This step's drafts: row i (seq_ids[i]) has counts[i] of them in `values` (device int64,
        row after row); their copy to the host starts now, behind the work that computes them."""
        self.seq_ids, self.counts, self.values = np.asarray(seq_ids, np.int64), np.asarray(counts, np.int64), values
        n = values.shape[0]
        if self.copied is None:  # the CPU: the values are the host's
            self.host = values
            return
        if self._pinned is None or self._pinned.shape[0] < n:
            self._pinned = torch.empty(max(n, 256), dtype=torch.int64, pin_memory=True)
        self.host = self._pinned[:n]
        streams.copy_async(self.host, values, self.device, self.copied)

    def _batch_order(self, batch) -> tuple[np.ndarray, np.ndarray | None] | None:
        """(destination token index in the batch, index into values; None: values as they are) of
        every draft the batch carries, in batch order; None when it carries none of these rows'."""
        if self.seq_ids is None:
            return None
        d = np.asarray(batch.num_draft_tokens, dtype=np.int64)
        rows = np.flatnonzero(d)
        if not len(rows):
            return None
        seq_ids, n = np.asarray(batch.seq_ids)[rows], d[rows]
        offset = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
        dst = np.repeat(np.asarray(batch.query_start_loc, dtype=np.int64)[rows] + 1, n) + offset
        if np.array_equal(seq_ids, self.seq_ids) and np.array_equal(n, self.counts):
            return dst, None  # the usual step: the proposed rows, in order, none trimmed
        at = index_of(self.seq_ids, seq_ids)
        assert (at >= 0).all(), "a verify row's drafts are not on the device"
        assert (n <= self.counts[at]).all(), "the batch carries more drafts than were proposed"
        starts = np.cumsum(self.counts) - self.counts
        return dst, np.repeat(starts[at], n) + offset

    def patch_for(self, batch) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(token indices, their ids) on the device for the runner to write over the batch's
        placeholders (ModelRunner.execute's token_patch); None: nothing to patch."""
        both = self._batch_order(batch)
        self._order = (batch, both)
        if both is None:
            return None
        assert self.values is not None
        dst, src = both
        if src is None:
            return to_device(dst, self.device), self.values
        index = to_device(np.stack(both), self.device)
        return index[0], self.values.index_select(0, index[1])

    def resolve(self, scheduler, batch) -> None:
        """The drafts' values into the scheduler's draft rows and the batch's input ids (after the
        step's forward is launched with patch_for(batch): the wait is for the chain, which the
        forward follows)."""
        assert self._order is not None and self._order[0] is batch, "resolve() follows patch_for() of its batch"
        both, self._order = self._order[1], None
        if both is None:
            return
        if self.copied is not None:
            self.copied.synchronize()
        assert self.host is not None
        values = self.host.numpy() if both[1] is None else self.host.numpy()[both[1]]
        values = values.astype(np.int32)
        scheduler.fill_drafts(batch, values)
