"""The reference of hipkernels/spec/next_verify_step.h: from a greedy step's argmax, each row's
acceptance, its history appended, its prompt-lookup drafts (csrc/core/ngram_proposer.h, the host
proposer's own lookup) and the next verify step's static graph inputs (csrc/core/graph_staging.h's
layout). Runs on CPU tensors (the CPU engine's graph-runner path) and is what the kernel is tested
against. A drafting layer's steps run it in two phases (next_verify_step.h): ACCEPT (acceptance and
history, each row's draft limit in result[:, 1], no drafts), then LAYER_DRAFTS (the drafts from the
layer's [draft, row] buffer, then the staging)."""
from __future__ import annotations

import numpy as np
import torch

from pyengine import _C

# the per-row fields of rows_in (next_verify_step.h, NextVerifyRowField); then max_drafts drafts and
# max_drafts + 1 predicted tokens
(PREV_START, PREV_DRAFTS, FIRST_POSITION, MAX_DRAFTS, TOKENS_LEFT, HISTORY_ROW, SYNC_FROM, SYNC_COUNT, SYNC_OFFSET,
 PREDICTED) = range(10)
ROW_FIELDS = 10
WHOLE, ACCEPT, LAYER_DRAFTS = range(3)  # next_verify_step.h, NextVerifyPhase


def row_width(max_drafts: int) -> int:
    """int64 values a row of rows_in holds."""
    return ROW_FIELDS + 2 * max_drafts + 1


def next_verify_step(argmax: torch.Tensor, rows_in: torch.Tensor, sync_tokens: torch.Tensor, history: torch.Tensor,
                     block_tables: torch.Tensor, inputs: torch.Tensor, result: torch.Tensor, *, block_size: int,
                     max_context: int, token_capacity: int, row_capacity: int, rows: int, padded_rows: int, q: int,
                     token_slots: int, max_drafts: int, min_n: int, max_n: int, phase: int = WHOLE,
                     layer_drafts: torch.Tensor | None = None) -> None:
    """In place: history (sync, then the accepted drafts and the bonus token), result [rows,
    3 + max_drafts] ([accepted, drafts, bonus, drafts ...]) and inputs (the next step's ids,
    positions, slots, context lengths and query starts, padding rows included). phase ACCEPT
    leaves the drafts to a layer (result[:, 1]: how many each row may take), LAYER_DRAFTS takes
    them from layer_drafts [>= each row's limit, >= rows] (draft j of row r at [j, r]) and stages."""
    am, info, sync = argmax.numpy(), rows_in.numpy()[:rows], sync_tokens.numpy()
    hist, tables, res = history.numpy(), block_tables.numpy(), result.numpy()
    if phase == LAYER_DRAFTS:
        assert layer_drafts is not None and layer_drafts.shape[1] >= rows
        taken = layer_drafts.numpy()
        for r in range(rows):
            res[r, 3:3 + res[r, 1]] = taken[:res[r, 1], r]
        _stage(inputs.numpy(), info, tables, res, block_size, token_capacity, row_capacity, rows, padded_rows, q,
               token_slots)
        return
    for r in range(rows):
        f = info[r]
        h = hist[f[HISTORY_ROW]]
        h[f[SYNC_FROM]:f[SYNC_FROM] + f[SYNC_COUNT]] = sync[f[SYNC_OFFSET]:f[SYNC_OFFSET] + f[SYNC_COUNT]]
        drafts, start, p0 = f[ROW_FIELDS:ROW_FIELDS + f[PREV_DRAFTS]], f[PREV_START], f[FIRST_POSITION]
        a = 0
        while a < len(drafts) and drafts[a] == am[start + a]:
            a += 1
        bonus = am[start + a]
        h[p0 + 1:p0 + 1 + a] = drafts[:a]
        h[p0 + 1 + a] = bonus
        first, left = p0 + 1 + a, f[TOKENS_LEFT] - a - 1
        limit = 0 if left < 2 else min(f[MAX_DRAFTS], q - 1, left - 1)
        ok = 0  # drafts whose positions have a block and stay within the context limit
        while ok < limit:
            pos = first + 1 + ok
            if pos + 1 > max_context or pos // block_size >= tables.shape[1] or tables[r, pos // block_size] < 0:
                break
            ok += 1
        if phase == ACCEPT:
            res[r, :3] = (a, ok, bonus)
            continue
        predicted = f[ROW_FIELDS + max_drafts:ROW_FIELDS + max_drafts + f[PREDICTED]]
        if a == len(drafts) and len(predicted) > 1 and predicted[0] == bonus and ok:
            found = predicted[1:1 + ok]  # the host's prediction held
        elif ok and min_n > 0:
            found = _C.propose_ngram(np.ascontiguousarray(h[:first + 1]), min_n, max_n, ok)
        else:
            found = []
        res[r, :3] = (a, len(found), bonus)
        res[r, 3:3 + len(found)] = found
    if phase == ACCEPT:
        return
    _stage(inputs.numpy(), info, tables, res, block_size, token_capacity, row_capacity, rows, padded_rows, q,
           token_slots)


def _stage(h64: np.ndarray, info: np.ndarray, tables: np.ndarray, res: np.ndarray, block_size: int, T: int, R: int,
           rows: int, padded_rows: int, q: int, token_slots: int) -> None:
    ids, pos, slots = h64[0:T], h64[T:2 * T], h64[2 * T:3 * T]
    ctx, qsl = h64[3 * T:3 * T + R], h64[3 * T + R:3 * T + 2 * R + 1]
    counts = 1 + res[:rows, 1]
    qsl[0] = 0
    qsl[1:rows + 1] = np.cumsum(counts)
    n = int(qsl[rows])
    qsl[rows + 1:padded_rows + 1] = np.minimum(n + q * np.arange(1, padded_rows - rows + 1), token_slots)
    for r in range(rows):
        first, at, c = info[r, FIRST_POSITION] + 1 + res[r, 0], qsl[r], counts[r]
        p = first + np.arange(c)
        blocks = tables[r, p // block_size].astype(np.int64)
        ids[at:at + c] = np.concatenate(([res[r, 2]], res[r, 3:3 + c - 1]))
        pos[at:at + c] = p
        slots[at:at + c] = np.where(blocks < 0, -1, blocks * block_size + p % block_size)
        ctx[r] = first + c
    ids[n:token_slots], pos[n:token_slots], slots[n:token_slots] = 0, 0, -1
    ctx[rows:padded_rows] = 0
