"""A contiguous range of a scheduled batch's rows as a batch of its own.

A step that mixes decode/verify rows with prefill rows runs them as two CUDA-graph replays (see
CudaGraphRunner.execute_mixed): the decode rows [0, num_decode_rows) on their decode/verify graph,
the prefill rows after them on a prefill graph. Rows never read each other's tokens or KV, so
running them apart gives each row the same inputs; a part carries the arrays the graph runner
stages, with query_start_loc and logits_indices counted from the part's first token.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class StepPart:
    seq_ids: np.ndarray
    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    query_start_loc: np.ndarray  # [rows + 1], from 0
    context_lens: np.ndarray
    block_tables: np.ndarray  # [rows, max_blocks]
    num_logits: np.ndarray  # per row
    logits_indices: np.ndarray  # tokens whose logits the step wants, counted from the part's first token
    num_decode_rows: int

    @property
    def num_rows(self) -> int:
        return len(self.context_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.query_start_loc[-1])


def rows_of(batch, lo: int, hi: int) -> StepPart:
    """Rows [lo, hi) of a ScheduledBatch (decode rows come first, so a range starting at
    num_decode_rows holds prefill rows only). Array views where the batch's arrays allow."""
    qsl = np.asarray(batch.query_start_loc)
    t0, t1 = int(qsl[lo]), int(qsl[hi])
    li = np.asarray(batch.logits_indices)
    cum = np.concatenate(([0], np.cumsum(batch.num_logits)))
    return StepPart(
        seq_ids=np.asarray(batch.seq_ids)[lo:hi],
        input_ids=np.asarray(batch.input_ids)[t0:t1],
        positions=np.asarray(batch.positions)[t0:t1],
        slot_mapping=np.asarray(batch.slot_mapping)[t0:t1],
        query_start_loc=qsl[lo:hi + 1] - t0,
        context_lens=np.asarray(batch.context_lens)[lo:hi],
        block_tables=np.asarray(batch.block_tables)[lo:hi],
        num_logits=np.asarray(batch.num_logits)[lo:hi],
        logits_indices=li[int(cum[lo]):int(cum[hi])] - t0,
        num_decode_rows=max(0, min(hi, int(batch.num_decode_rows)) - lo),
    )
