"""_C.stage_graph_step (csrc/core/graph_staging.h), which CudaGraphRunner._stage calls, against its NumPy
form before the port (kept here as the reference): random steps of decode/verify and prefill graph
shapes, with and without input ids, over buffers holding a previous step's values; every staged
value must be equal, the values past the graph's slots and rows left alone."""
from __future__ import annotations

import numpy as np
import pytest

from pyengine import _C
from pyengine.engine.graph_capture import graph_shape


def reference_stage(np64, np32, T, R, key, rows, qsl, ids, pos, slots, ctx, tables) -> None:
    n = int(qsl[rows])
    h = np64
    if ids is not None:
        h[0:n] = ids
    h[T:T + n] = pos
    h[2 * T:2 * T + n] = slots
    h[3 * T:3 * T + rows] = ctx
    h[3 * T + R:3 * T + R + rows + 1] = qsl
    b, q, hi, _ = graph_shape(key)
    r = 2 * b
    h[n:hi] = 0
    h[T + n:T + hi] = 0
    h[2 * T + n:2 * T + hi] = -1
    h[3 * T + rows:3 * T + r] = 0
    h[3 * T + R + rows + 1:3 * T + R + r + 1] = np.minimum(n + q * np.arange(1, r - rows + 1), hi)
    np32[:rows, :tables.shape[1]] = tables


@pytest.mark.parametrize("seed", range(4))
def test_stage_graph_step_equals_the_numpy_reference(seed: int) -> None:
    rng = np.random.default_rng(seed)
    max_rows, max_q, width = 8, 5, 12
    T, R = max_rows * max_q, 2 * max_rows
    buffers = [(rng.integers(-9, 9, 3 * T + 2 * R + 1), rng.integers(-9, 9, (R, width)).astype(np.int32))]
    buffers.append((buffers[0][0].copy(), buffers[0][1].copy()))
    for step in range(200):
        b = int(rng.choice([1, 2, 4, 8]))
        rows = int(rng.integers(0 if step % 17 == 0 else 1, b + 1))
        if step % 5 == 0:  # a prefill-shaped graph (b, -t): one row may hold all t tokens
            t = int(rng.choice([16, 32, 40]))
            key = (b, -t)
            lens = rng.multinomial(int(rng.integers(rows, t + 1)), np.ones(rows) / rows) if rows else np.zeros(0, int)
            lens = np.maximum(lens, 1) if rows else lens
            while lens.sum() > t:
                lens[np.argmax(lens)] -= 1
        else:
            q = int(rng.integers(1, max_q + 1))
            key = (b, q)
            lens = rng.integers(1, q + 1, rows)
        qsl = np.concatenate(([0], np.cumsum(lens))).astype(np.int32)
        n = int(qsl[-1])
        ids = None if step % 3 == 0 else rng.integers(0, 50000, n)
        pos, slots = rng.integers(0, 4096, n), rng.integers(-1, 9999, n)
        ctx = rng.integers(1, 4096, rows).astype(np.int32)
        tables = rng.integers(-1, 500, (rows, int(rng.integers(1, width + 1)))).astype(np.int32)
        _C.stage_graph_step(*buffers[0], T, R, 2 * b, graph_shape(key)[1], graph_shape(key)[2], qsl, ids, pos, slots,
                            ctx, tables)
        reference_stage(*buffers[1], T, R, key, rows, qsl, ids, pos, slots, ctx, tables)
        assert np.array_equal(buffers[0][0], buffers[1][0]), step
        assert np.array_equal(buffers[0][1], buffers[1][1]), step


def test_stage_graph_step_rejects_a_step_larger_than_its_graph() -> None:
    T, R, width = 8, 4, 4
    np64, np32 = np.zeros(3 * T + 2 * R + 1, dtype=np.int64), np.zeros((R, width), dtype=np.int32)
    qsl = np.array([0, 3, 6], dtype=np.int32)
    args = (qsl, None, np.zeros(6, np.int64), np.zeros(6, np.int64), np.ones(2, np.int32), np.zeros((2, 2), np.int32))
    with pytest.raises(ValueError, match="tokens for 4 slots"):
        _C.stage_graph_step(np64, np32, T, R, 2, 2, 4, *args)  # 6 tokens for a graph of 4 token slots
    with pytest.raises(ValueError, match="2 rows for 1 padded rows"):
        _C.stage_graph_step(np64, np32, T, R, 1, 3, 6, *args)


def test_launch_rows_matches_the_tables() -> None:
    """_C.launch_rows (a step launched ahead, CudaGraphRunner._launch): each row's positions from
    its first on, its slots through its own table row, context lengths, the table entries each
    context spans; None where a position's block is missing (-1 or past the table) or a context
    passes the limit."""
    rng = np.random.default_rng(3)
    B, rows, width = 4, 5, 6
    tables = rng.permutation(rows * width).astype(np.int32).reshape(rows, width)
    first = np.array([0, 3, 7, 11, 19], dtype=np.int64)
    counts = np.array([1, 5, 2, 4, 1], dtype=np.int32)
    qsl, pos, slots, ctx, num_blocks = _C.launch_rows(first, counts, tables, B, width * B)
    assert qsl.tolist() == [0, 1, 6, 8, 12, 13]
    want_pos = np.concatenate([np.arange(f, f + c) for f, c in zip(first, counts)])
    row_of = np.repeat(np.arange(rows), counts)
    assert pos.tolist() == want_pos.tolist()
    assert slots.tolist() == (tables[row_of, want_pos // B].astype(np.int64) * B + want_pos % B).tolist()
    assert ctx.tolist() == (first + counts).tolist() and num_blocks.tolist() == ((first + counts - 1) // B + 1).tolist()
    missing = tables.copy()
    missing[1, 1] = -1  # row 1's positions 4..7
    assert _C.launch_rows(first, counts, missing, B, width * B) is None
    assert _C.launch_rows(first, counts, tables[:, :4], B, width * B) is None  # row 4's position 19: column 4
    assert _C.launch_rows(first, counts, tables, B, 19) is None  # row 4's context 20 > 19
