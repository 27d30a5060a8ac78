"""A step's host (numpy) arrays: onto the device without waiting for the stream, and its drafts.

A plain `torch.from_numpy(a).to(device)` copies synchronously: the host waits until the stream has
run everything queued before the copy. While a step launched ahead (async decode) runs, that is the
whole next forward, and the host's work meant to overlap it waits instead. A non-blocking copy of
pageable memory returns once the driver has staged it (H100: 14 us for a small index array behind
~10 ms of queued work, against 10.5 ms blocking; through page-locked memory 40 us).
"""
from __future__ import annotations

import numpy as np
import torch


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """`array` as a tensor on `device` (itself on the CPU), queued on the current stream."""
    t = torch.from_numpy(np.ascontiguousarray(array))
    return t if device.type == "cpu" else t.to(device, non_blocking=True)


def draft_token_ids(batch) -> np.ndarray:
    """The step's drafts, flat in row order (row r's are the num_draft_tokens[r] inputs after its
    first token; cu_num_draft_tokens gives where each row's start)."""
    cu, starts = batch.cu_num_draft_tokens, batch.query_start_loc[:-1] + 1
    return np.asarray(batch.input_ids)[np.arange(int(cu[-1])) + np.repeat(starts - cu[:-1], batch.num_draft_tokens)]


def index_of(keys: np.ndarray, queries: np.ndarray, keys_sorted: bool = False) -> np.ndarray:
    """Each query's index in keys (distinct values, any order; keys_sorted: ascending, no sort
    here), -1 where it is not there."""
    if not len(keys):
        return np.full(len(queries), -1, dtype=np.int64)
    if keys_sorted:
        at = np.minimum(np.searchsorted(keys, queries), len(keys) - 1)
    else:
        order = np.argsort(keys, kind="stable")
        at = order[np.minimum(np.searchsorted(keys, queries, sorter=order), len(keys) - 1)]
    return np.where(keys[at] == queries, at, -1)
