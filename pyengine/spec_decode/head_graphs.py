"""CUDA graphs for a drafting layer's short forwards (an MTP layer, an EAGLE-3 head): the catch-up of
decode rows (each row feeds the 1..k + 1 tokens its last verify step accepted) and the k - 1 chained
draft steps (one token per row).

It is CudaGraphRunner (pyengine/engine/cuda_graph_runner.py) with the layer as its model: the same
static device byte buffer filled by one pinned host-to-device copy, one graph per (batch bucket b,
longest row q) captured lazily, the rows' tokens packed at the front of the b * q token slots and
padding rows after them (slot -1: no KV write; context 0: nothing read; their outputs dropped), one
memory pool for these graphs (not the target's: a head replay between the target's step and its
sampling would be free to overwrite the target's outputs otherwise). What it adds:
- prev_hidden, the hidden state before each token, in a static device buffer [T, hidden] that run()
  fills by one device-to-device copy;
- the logits of each row's last token, computed inside the graph (layer.compute_logits).
Outputs are static: the caller consumes them (copies, samples) before the next run(). On a CPU
device nothing is captured and the same static-buffer path runs eagerly, so CPU tests exercise it.
Longer catch-ups (rows that deferred theirs for a few steps: HiddenRing; a new request's prompt)
replay prefill-shaped graphs (b, -t) of t token slots (16, 32, ... up to catch_up_tokens; any
bucket's rows, past the target's PREFILL_GRAPH_ROWS), which compute the same outputs and
last-token logits; longer ones are the caller's: key_for gives None, and the proposer runs them
eagerly (on the H100, EAGLE-3's drafting steps at batch 16 went from 4.0-4.2 to 3.0 ms when their
catch-ups of more than 8 rows became replays).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from pyengine.engine.cuda_graph_runner import CudaGraphRunner
from pyengine.engine.graph_capture import graph_shape, last_tokens


@dataclass
class HeadFeed:
    """One forward of the drafting layer: rows of consecutive tokens in the target's block tables
    (a ScheduledBatch-like subset of fields that ModelRunner.build_metadata and CudaGraphRunner read)."""
    input_ids: np.ndarray | None  # [n] int64; None: the tokens come as a device tensor
    positions: np.ndarray  # [n] int64
    slot_mapping: np.ndarray  # [n] int64
    query_start_loc: np.ndarray  # [rows + 1] int32
    context_lens: np.ndarray  # [rows] int32
    block_tables: np.ndarray  # [rows, W] int32, -1 past each row's used blocks
    max_query_len: int
    max_context_len: int

    @staticmethod
    def build(tables: np.ndarray, starts: np.ndarray, lens: np.ndarray, block_size: int,
              input_ids: np.ndarray | None = None) -> HeadFeed:
        """Row i feeds lens[i] tokens from position starts[i] on, writing their slots of tables[i]
        and attending to every position before (what rows_batch builds, without a per-row loop)."""
        B = block_size
        starts, lens = starts.astype(np.int64), lens.astype(np.int64)
        ctx = starts + lens
        qsl = np.zeros(len(lens) + 1, dtype=np.int32)
        np.cumsum(lens, out=qsl[1:])
        n = int(qsl[-1])
        row = np.repeat(np.arange(len(lens)), lens)
        positions = starts[row] + np.arange(n, dtype=np.int64) - qsl[:-1][row]
        used = -(-ctx // B)
        width = int(used.max())
        table = tables[:, :width].astype(np.int32)  # a copy: the mask below must not touch the caller's
        table[np.arange(width)[None, :] >= used[:, None]] = -1
        slots = table[row, positions // B].astype(np.int64) * B + positions % B
        return HeadFeed(input_ids, positions, slots, qsl, ctx.astype(np.int32), table, int(lens.max()), int(ctx.max()))


class HeadGraphs(CudaGraphRunner):
    """Captures (lazily) and replays a drafting layer's forwards of rows of at most max_q tokens."""

    def __init__(self, layer, kv_cache, block_size: int, device: torch.device, max_num_seqs: int, max_q: int,
                 graph_max_context: int, catch_up_tokens: int = 0,
                 prev_width: tuple[int, torch.dtype] | None = None) -> None:
        super().__init__(layer, kv_cache, block_size, device, max_num_seqs, max_q, graph_max_context,
                         prefill_tokens=catch_up_tokens)
        # [T, hidden]: the layer's input states; made here if prev_width (width, dtype) is given, else on the first run
        self.prev: torch.Tensor | None = None if prev_width is None else \
            torch.zeros(self.T, prev_width[0], dtype=prev_width[1], device=device)
        self.forward_seconds: dict[int, float] = {}  # bucket -> a chained forward's cost (measure_forward_seconds)

    @property
    def prefill_rows(self) -> int:
        """Rows a prefill-shaped graph may hold: every bucket's (a drafting step's catch-up feeds
        every drafting row, each with the positions it deferred)."""
        return self.max_rows

    @torch.inference_mode()
    def measure_forward_seconds(self, replays: int = 20) -> None:
        """Time, once (start-up, before any step), what one chained draft forward of each bucket
        costs on the host's critical path: the feed's arrays built and staged, the replay (q = 1,
        padding rows: no KV written) and the wait for its tokens. A drafting step runs its forwards
        one after the other, so host and GPU time add up. Fixed afterwards (the draft-length
        policy's price of a drafting depth)."""
        if not self.use_graphs or self.forward_seconds or self.prev is None:
            return
        for b in self.buckets:
            key = (b, 1)
            if key not in self.graphs:
                self.graphs[key] = self._capture(key)
            graph, (logits, _) = self.graphs[key]
            tables = np.full((b, 1), -1, dtype=np.int32)
            torch.cuda.synchronize(self.device)
            start = time.perf_counter()
            for _ in range(replays):
                HeadFeed.build(tables, np.zeros(b, dtype=np.int64), np.ones(b, dtype=np.int64), self.block_size)
                self._stage_padding(key)
                graph.replay()
                logits[:b].argmax(dim=-1).tolist()
            self.forward_seconds[b] = (time.perf_counter() - start) / replays

    def forward_cost(self, rows: int) -> float | None:
        """Seconds of one chained forward of `rows` rows' bucket (measure_forward_seconds), None: not measured."""
        if rows < 1 or rows > self.max_rows:
            return None
        return self.forward_seconds.get(next(x for x in self.buckets if x >= rows))

    def key_for(self, feed: HeadFeed) -> tuple[int, int] | None:
        """(bucket, q) when the feed can replay a graph, else None (the caller runs it eagerly)."""
        rows = len(feed.context_lens)
        if rows == 0 or rows > self.max_rows:
            return None
        if feed.block_tables.shape[1] > self.width or feed.max_context_len > self.width * self.block_size:
            return None
        bucket = next(x for x in self.buckets if x >= rows)
        if feed.max_query_len <= self.max_q:
            return bucket, feed.max_query_len
        n = int(feed.query_start_loc[rows])  # a longer catch-up: a prefill-shaped graph, if one holds it
        if not self.prefill_buckets or rows > self.prefill_rows or n > self.prefill_buckets[-1]:
            return None
        return bucket, -next(t for t in self.prefill_buckets if t >= n)

    @torch.inference_mode()
    def run(self, key: tuple[int, int], feed: HeadFeed, prev_hidden: torch.Tensor,
            token_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's output for every token [n, hidden] and the logits of each row's last token
        [rows, vocab]: static buffers, valid until the next run. token_ids (device int64 [n]) stands
        for feed.input_ids when those are None."""
        rows = len(feed.context_lens)
        n = int(feed.query_start_loc[rows])
        if self.prev is None:
            self.prev = torch.zeros(self.T, prev_hidden.shape[1], dtype=prev_hidden.dtype, device=self.device)
        self.prev[:n].copy_(prev_hidden)
        if self.use_graphs and key not in self.graphs:
            self.graphs[key] = self._capture(key)  # padding inputs only; then stage the feed below
        self._stage(key, rows, feed.query_start_loc, feed.input_ids, feed.positions, feed.slot_mapping,
                    feed.context_lens, feed.block_tables)
        logits = self._run(key, n, token_ids)
        assert self.last_hidden is not None
        return self.last_hidden, logits[:rows]

    def _forward(self, key: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits of rows 0..b-1's last tokens, the layer's output for every token slot): what a
        replay computes. A padding row without tokens repeats the token before it (dropped)."""
        b, _, n, _ = graph_shape(key)
        assert self.prev is not None
        meta, ids, pos = self._meta(key)
        out = self.model(ids, pos, self.prev[:n], meta, self.kv_caches)
        return self.model.compute_logits(out.index_select(0, last_tokens(meta, b))), out
