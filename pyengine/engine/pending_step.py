"""A step launched ahead (async decode, CudaGraphRunner.launch_next; a verify step after a verify
step, pyengine/engine/verify_ahead.py, or one built on the device, device_verify.py): what it ran
with, and the test that the scheduler's next batch is that step."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch


@dataclass
class PendingStep:
    """A decode / verify step launched before its batch was scheduled: the inputs it ran with, and
    its logits (a view of the graph's static output, valid until the next replay)."""
    key: tuple[int, int]
    logits: torch.Tensor
    seq_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    context_lens: np.ndarray
    block_tables: np.ndarray
    num_blocks: np.ndarray  # per row, the table entries its forward read (its context's blocks)
    # every row a decode / verify row: its query length is 1 + its drafts
    query_start_loc: np.ndarray
    input_ids: np.ndarray | None = field(default=None)  # async decode: the launching step's tokens, once known
    # verify ahead: the tokens and counts per row the launching step must commit for this step to
    # follow, and the drafts per row (flat, counts) the scheduler is given for it
    expected: tuple[np.ndarray, np.ndarray] | None = field(default=None)
    drafts: tuple[np.ndarray, np.ndarray] | None = field(default=None)
    from_device: bool = False  # built on the device from the launching step's argmax (device_verify.py)
    # a drafting layer's step built on the device: its drafts (and so its input ids) reach the host
    # after its launching step's tokens; fill(self) waits for them and sets both (complete())
    fill: Callable[["PendingStep"], None] | None = field(default=None)

    def complete(self) -> None:
        """Wait for what a step built on the device sends after its acceptance (fill)."""
        if self.fill is not None:
            fill, self.fill = self.fill, None
            fill(self)

    def matches(self, batch) -> bool:
        """Is `batch` exactly the step that was launched (rows, order and every input the forward
        reads, of the block tables each row's context blocks: a table may have gained a block past
        them since, the next step's lookahead)? Then its logits are the ones this batch would compute."""
        self.complete()
        rows = len(self.seq_ids)
        return (self.input_ids is not None and batch.num_rows == rows and batch.num_decode_rows == rows
                and np.array_equal(batch.seq_ids, self.seq_ids)
                and np.array_equal(batch.input_ids, self.input_ids)
                and np.array_equal(batch.positions, self.positions)
                and np.array_equal(batch.slot_mapping, self.slot_mapping)
                and np.array_equal(batch.context_lens, self.context_lens)
                and np.array_equal(batch.query_start_loc, self.query_start_loc)
                and self._same_blocks(np.asarray(batch.block_tables)))

    def _same_blocks(self, tables: np.ndarray) -> bool:
        need = int(self.num_blocks.max(initial=0))
        if tables.ndim != 2 or tables.shape[1] < need:
            return False
        read = np.arange(need)[None, :] < self.num_blocks[:, None]
        return np.array_equal(tables[:, :need][read], self.block_tables[:, :need][read])
