"""Recurrent-state pool of hybrid models (Mamba2 and Gated DeltaNet layers): conv and SSM state
tensors indexed by slot.

The scheduler owns the slots (SchedulerConfig.num_state_slots; each request holds 1 + k of them,
admission charges KV blocks and slots together); this pool owns the tensors. Per Mamba layer:
    conv[layer] [num_slots, W - 1 + k, conv_dim]   model dtype; a window read at offset a - 1
    ssm[layer]  [num_slots, H, P, N]              fp32; slot idx[n, a - 1] holds the valid state
Semantics of slots and offsets: pyengine/ops/reference/ssm.py. Gated DeltaNet layers (shapes given as
DeltaRuleShapes) keep the same conv windows, but their ssm slots hold the state after a step's
first token in idx[n, 0] and a record per later token in idx[n, t] (pyengine/ops/reference/gdn.py).

Every decode row (with or without drafts) runs the one speculative path (T = 1 + drafts tokens,
read at slot / offset a - 1); prefill rows start from zeros (num_computed == 0) or from the state
their previous chunk (or a restored checkpoint) left at offset 0 (a = 1).

Prefix caching: slots from num_running_slots on are checkpoints, each the state at the end of one
hashed KV block (csrc/core/state_checkpoints.h). The scheduler lists the copies a step needs
(ScheduledBatch.state_copies): saves of the last step's states into checkpoints, then restores of a
checkpoint into an admitted request's first slot; apply_copies runs them before the forward. A save
of a Gated DeltaNet layer materialises base + records (ScheduledBatch.state_copy_slots names the
source row's slots, the conv offset t the number of records).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pyengine import ops
from pyengine.engine.host_arrays import to_device


class DeltaRuleShapes(tuple):
    """(conv row shape, ssm shape) of a Gated DeltaNet layer: its ssm slots hold a base state and
    per-token records, so checkpoint saves materialise the state instead of copying a slot."""


@dataclass
class StateMetadata:
    """One step's view of the pool, read by every Mamba layer (rows ordered decode rows first)."""
    conv: list[torch.Tensor | None]  # per layer (None for attention layers)
    ssm: list[torch.Tensor | None]
    state_idx: torch.Tensor  # [R, 1 + k] int32 slots, PAD = -1
    num_accepted: torch.Tensor  # [R] int32: a, tokens the row's previous step committed (1 after prefill)
    has_initial_state: torch.Tensor  # [R] bool: prefill rows with num_computed > 0 (decode rows: True)
    query_start_loc: torch.Tensor  # [R + 1] int32
    num_decode_rows: int
    num_decode_tokens: int

    def decode_rows(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(query_start_loc, state_idx, num_accepted) of the decode/verify rows."""
        nd = self.num_decode_rows
        return self.query_start_loc[:nd + 1], self.state_idx[:nd], self.num_accepted[:nd]

    def prefill_rows(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(query_start_loc from 0, state_idx, num_accepted, has_initial_state) of the prefill rows."""
        nd = self.num_decode_rows
        return (self.query_start_loc[nd:] - self.num_decode_tokens, self.state_idx[nd:], self.num_accepted[nd:],
                self.has_initial_state[nd:])


class StateCache:
    def __init__(self, shapes: list[tuple[tuple[int, ...], tuple[int, ...]] | None], num_slots: int,
                 dtype: torch.dtype, device: torch.device, num_spec_tokens: int = 0, num_checkpoints: int = 0) -> None:
        """shapes: per layer, (conv row shape [W - 1 + k, conv_dim], ssm shape [H, P, N]) or None;
        num_slots running slots (1 + k per request), then num_checkpoints checkpoint slots."""
        self.num_running_slots, self.num_checkpoints = num_slots, num_checkpoints
        self.num_slots, self.device, self.num_spec_tokens = num_slots + num_checkpoints, device, num_spec_tokens
        num_slots = self.num_slots
        # Zero-filled: a prefill from scratch never reads the pool, but a reference run that
        # inspects a slot never sees uninitialised memory.
        self.conv = [None if s is None else torch.zeros((num_slots, *s[0]), dtype=dtype, device=device) for s in shapes]
        self.ssm = [None if s is None else torch.zeros((num_slots, *s[1]), dtype=torch.float32, device=device)
                    for s in shapes]
        self.records = [isinstance(s, DeltaRuleShapes) for s in shapes]

    def bytes_per_slot(self) -> int:
        return sum(t[0].numel() * t.element_size() for t in self.conv + self.ssm if t is not None)

    def apply_copies(self, batch) -> None:  # batch: _C.ScheduledBatch
        """The step's checkpoint saves, then its restores (a restore may read a checkpoint saved in
        the same batch; a save may read a slot a restore is about to overwrite)."""
        copies = batch.state_copies
        if copies.shape[0] == 0:
            return
        saves, slots = int(batch.num_state_saves), batch.state_copy_slots
        for part in (slice(0, saves), slice(saves, copies.shape[0])):
            if part.stop > part.start:
                self._copy(self._tensor(copies[part]).long(), self._tensor(slots[part]))

    def _copy(self, copies: torch.Tensor, source_slots: torch.Tensor) -> None:
        """copies [n, 4] (ssm slot, conv line, conv offset, destination): state[dst] = state[ssm slot]
        (Gated DeltaNet: base source_slots[:, 0] + the records source_slots[:, 1..offset]);
        conv[dst][0, W-1) = conv[line][offset, offset + W-1): the window valid at that offset."""
        src, line, offset, dst = copies.unbind(1)
        for conv, ssm, records in zip(self.conv, self.ssm, self.records):
            if ssm is None:
                continue
            if records:
                ops.gated_delta_rule_materialise(ssm, source_slots, (offset + 1).to(torch.int32), dst.to(torch.int32))
            else:
                ssm.index_copy_(0, dst, ssm.index_select(0, src))
            window = torch.arange(conv.shape[1] - self.num_spec_tokens, device=conv.device)
            conv[dst[:, None], window] = conv[line[:, None], offset[:, None] + window]

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        return to_device(array, self.device)

    def prepare(self, batch, query_start_loc: torch.Tensor) -> StateMetadata:  # batch: _C.ScheduledBatch
        nd = int(batch.num_decode_rows)
        init = np.asarray(batch.num_computed) > 0
        init[:nd] = True
        accepted = np.maximum(np.asarray(batch.num_accepted_prev, dtype=np.int32), 1)
        # prefill rows start from their base slot alone (the chunk-wise GDN prefill replays no records)
        assert (accepted[nd:] == 1).all(), "a prefill row with num_accepted > 1"
        return StateMetadata(
            conv=self.conv, ssm=self.ssm,
            state_idx=self._tensor(np.asarray(batch.state_slots, dtype=np.int32).reshape(batch.num_rows, -1)),
            num_accepted=self._tensor(accepted),
            has_initial_state=self._tensor(init),
            query_start_loc=query_start_loc,
            num_decode_rows=nd,
            num_decode_tokens=int(batch.query_start_loc[nd]),
        )

    @classmethod
    def scratch(cls, model, query_start_loc: torch.Tensor, dtype: torch.dtype, device: torch.device) -> StateMetadata:
        """A throw-away pool for a standalone forward (no engine): every row a prefill from zeros."""
        rows = int(query_start_loc.shape[0]) - 1
        cache = cls(model.state_shapes(0), rows, dtype, device)
        return StateMetadata(
            conv=cache.conv, ssm=cache.ssm,
            state_idx=torch.arange(rows, dtype=torch.int32, device=device)[:, None],
            num_accepted=torch.ones(rows, dtype=torch.int32, device=device),
            has_initial_state=torch.zeros(rows, dtype=torch.bool, device=device),
            query_start_loc=query_start_loc, num_decode_rows=0, num_decode_tokens=0,
        )
