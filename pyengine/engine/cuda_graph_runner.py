"""CUDA graphs for decode and verify steps (one graph per (batch bucket, query length)).

A step qualifies when every row is a decode or verify row of at most q tokens (decode: 1; verify:
1 + its own draft count, ragged across rows) and every token wants logits (true of decode and
verify rows), the rows fit the largest bucket, and their block tables fit the static width. It
replays the graph of (bucket, q = its longest row): the rows' tokens sit packed at the front of
the graph's b * q token slots, as query_start_loc says; the graph has 2b rows, and the rows after
the step's own (padding up to the bucket size 1, 2, 4, 8, ..., then as many more) own the token
slots after its tokens, at most q each, with context length 0 and no KV write (slot -1). The kernels read each row's tokens through query_start_loc, so a row's
arithmetic is what an eager step gives it; the logits of the unowned slots are dropped. Steps with
prefill rows replay prefill graphs (pyengine/engine/prefill_graphs.py) or run eagerly.

Graph safety:
- Every input lives in one static device byte buffer, refreshed by a single host-to-device copy
  from a pinned staging buffer of the same layout: an int64 part [input_ids | positions | slots |
  context_lens | query_start_loc] then the int32 block tables of fixed width W = ceil(graph_max_context / block_size),
  so a bucket of b rows copies one prefix (through the first b table rows): host time before the
  replay is GPU idle time. The int32 conversions of the attention plan run inside the graph
  (pyengine.ops.cuda.attention.plan is called during capture on a fresh AttentionMetadata).
- The launch shape of the attention kernel depends on max_query_len (= q, fixed per graph), the
  number of rows (the bucket) and max_splits; the graph is captured with max_context_len =
  W * block_size, an upper bound of every row's context, so max_splits is fixed. The kernel's
  per-row split rule ignores max_splits (splits past a row's own count exit at once), so results
  are the same as eager. The split workspace is allocated during capture from the graph's pool.
- All graphs share one memory pool; only one replays at a time and the logits it returns are
  consumed (sampled) before the next replay: a graph's temporaries may lie where a graph captured
  after it keeps its static outputs.
- launch_next (async decode, pyengine/engine/launch_ahead.py): the decode step after a q = 1 step,
  staged from that step's batch with every row one position further (in the block the scheduler
  reserved ahead where the position starts one), its token ids copied on the device from
  the step's argmax (after the staging copy, which carries stale ids), then replayed, all before
  the host has seen the tokens. launch_verify (verify ahead): a step given in full on the host,
  its slots from the rows' tables. The engine uses their logits only if the scheduler's next
  batch equals the prediction (PendingStep.matches).
- Captures run under the kernel config current when the runner was made (the LLM's: its __init__
  sets it), which is the config every engine step runs under. A capture started outside a step
  (capture_all at start-up, a benchmark's warm-up) would otherwise record the kernels of whatever
  config the caller has (the process default: cuBLAS GEMMs, non-invariant attention splits), and
  its replays give other bits than the eager steps they stand for.
- Hybrid models (a StateCache): only steps whose rows are all decode/verify rows qualify (a prefill
  row reads and writes state differently). Each row's state slots and accepted count live in a
  static int32 buffer; padding rows get PAD slots, so the state kernels write nothing for them.
"""
from __future__ import annotations

import numpy as np
import torch

from pyengine import _C
from pyengine.engine.attention_metadata import AttentionMetadata
from pyengine.engine.graph_capture import capture_graph, default_buckets, default_token_buckets, graph_shape
from pyengine.engine.pending_step import PendingStep
from pyengine.engine.state_cache import StateMetadata
from pyengine.ops.reference.next_verify_step import row_width as built_row_width
from pyengine.engine.prefill_graphs import PrefillGraphs
from pyengine.ops import streams
from pyengine.ops.kernel_config import get_kernel_config, use_kernel_config

_PLAN_KEY = "cuda_paged_attention"


class CudaGraphRunner(PrefillGraphs):
    """Captures (lazily, on first use) and replays decode/verify steps of one ModelRunner (and, through
    PrefillGraphs, steps with prefill rows)."""

    def __init__(self, model, kv_caches, block_size: int, device: torch.device, max_num_seqs: int,
                 max_query_len: int, graph_max_context: int, state_cache=None, prefill_tokens: int = 0) -> None:
        self.model, self.kv_caches, self.block_size, self.device = model, kv_caches, block_size, device
        self.state_cache = state_cache  # pyengine.engine.state_cache.StateCache of a hybrid model, or None
        self.buckets = default_buckets(max_num_seqs)
        self.max_rows = self.buckets[-1]
        self.max_q = max(1, max_query_len)
        self.width = max(1, -(-graph_max_context // block_size))
        # On a CPU device nothing is captured: the same padded static-buffer path runs eagerly (so the
        # padding and async-decode logic run in the CPU tests).
        self.use_graphs = device.type == "cuda"
        self.kernel_config = get_kernel_config()  # every capture runs under it (see the module docstring)
        # prefill graphs (steps with prefill rows, see prefill_graphs.py): token capacities 16, 32, ...
        # up to prefill_tokens (0: none)
        self.prefill_buckets = default_token_buckets(prefill_tokens)
        T = max(self.max_rows * self.max_q, prefill_tokens)
        self.T = T
        # A graph of bucket b has 2b rows: the step's rows, then padding rows that own the token
        # slots after the step's tokens (at most q each: the rows' shape limits hold) or none.
        self.row_cap = 2 * self.max_rows
        # int64 layout: [input_ids T | positions T | slots T | context_lens 2R | query_start_loc 2R + 1 |
        # a prefill graph's logits tokens max_rows * max_q | a device-built step's rows max_rows x
        # built_fields], then int32 [2R, W] tables
        self.logits_at = 3 * T + 2 * self.row_cap + 1
        self.built_at = self.logits_at + (self.max_rows * self.max_q if prefill_tokens else 0)
        self.built_fields = built_row_width(self.max_q - 1)  # next_verify_step.h's rows_in
        self.n64 = self.built_at + self.max_rows * self.built_fields
        pin = self.use_graphs
        nbytes = 8 * self.n64 + 4 * self.row_cap * self.width
        self.host_bytes = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=pin)
        self.dev_bytes = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        self.host64, self.host32 = self._split(self.host_bytes)
        self.dev64, self.dev32 = self._split(self.dev_bytes)
        self.np64, self.np32 = self.host64.numpy(), self.host32.numpy()
        # bucket -> (host prefix, device prefix) that one step copies: made once, not per step
        self.staged = {b: (self.host_bytes[:self._prefix_bytes(b)], self.dev_bytes[:self._prefix_bytes(b)])
                       for b in self.buckets}
        # hybrid models: per row [state slots (1 + k) | accepted count]; decode rows always have a state
        S = self.max_q
        self.host_state = torch.zeros(self.row_cap, S + 1, dtype=torch.int32, pin_memory=pin)
        self.np_state = self.host_state.numpy()
        self.dev_state = torch.zeros(self.row_cap, S + 1, dtype=torch.int32, device=device)
        self.dev_init = torch.ones(self.row_cap, dtype=torch.bool, device=device)
        self.copy_done = torch.cuda.Event() if self.use_graphs else None
        # key -> (graph, its static (logits, hidden) outputs); decode/verify keys (b, q), prefill keys
        # (b, -t): b rows (the longest may hold all t tokens), logits of each row's last token
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph | None, tuple[torch.Tensor, torch.Tensor]]] = {}
        self.last_hidden: torch.Tensor | None = None  # the last step's final hidden states (MTP reads them)
        self.pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        self.num_replays = 0
        self.num_eager = 0
        self.num_mixed = 0  # steps with prefill rows replayed on a prefill graph
        self.replay_seconds: dict[int, np.ndarray] = {}  # bucket -> measured replay seconds, q = 1..max_q

    def _split(self, buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The int64 and int32 views of a staging/device byte buffer."""
        off = 8 * self.n64
        return buf[:off].view(torch.int64), buf[off:].view(torch.int32).view(self.row_cap, self.width)

    def _prefix_bytes(self, b: int) -> int:
        return 8 * self.n64 + 4 * 2 * b * self.width

    # ---- eligibility ------------------------------------------------------------------------
    def bucket_for(self, batch) -> tuple[int, int] | None:
        """(bucket rows, q) when the step can replay a graph, else None."""
        rows = len(batch.context_lens)
        qsl = np.asarray(batch.query_start_loc)
        n = int(qsl[-1])
        key = self._key(rows, np.diff(qsl))
        if key is None:
            return None
        li = np.asarray(batch.logits_indices)
        if len(li) != n or (n and (li[0] != 0 or li[-1] != n - 1)):
            return None
        if not self._tables_fit(batch):
            return None
        if self.state_cache is not None and int(batch.num_decode_rows) != rows:
            return None
        return key

    def _tables_fit(self, batch) -> bool:
        """The step's block tables and contexts fit the graphs' static width."""
        bt = np.asarray(batch.block_tables)
        return bt.ndim == 2 and bt.shape[1] <= self.width and \
            int(np.max(batch.context_lens)) <= self.width * self.block_size

    def _key(self, rows: int, lens: np.ndarray) -> tuple[int, int] | None:
        """(bucket rows, q) of a step of `rows` rows with these query lengths, if a graph runs it."""
        if rows == 0 or rows > self.max_rows:
            return None
        q = int(lens.max())
        if int(lens.min()) < 1 or q > self.max_q:
            return None
        if int(lens.min()) != q and not get_kernel_config().graph_ragged_verify:
            return None
        return next(x for x in self.buckets if x >= rows), q

    def step_costs(self, rows: int) -> np.ndarray | None:
        """Seconds of one replay of the decode/verify graph of `rows`' bucket for query lengths
        1..max_q (measure_step_costs' numbers), or None: not measured, or more rows than the largest bucket."""
        if rows < 1 or rows > self.max_rows:
            return None
        return self.replay_seconds.get(next(x for x in self.buckets if x >= rows))

    def graph_keys(self) -> list[tuple[int, int]]:
        """Every key a step may replay: decode/verify (b, q) for each bucket and q = 1..max_q, then
        the prefill keys."""
        return [(b, q) for b in self.buckets for q in range(1, self.max_q + 1)] + self.prefill_keys()

    @torch.inference_mode()
    def capture_all(self) -> int:
        """Capture every graph of graph_keys() not captured yet (start-up: otherwise each is
        captured on first use, a few eager forwards inside the step that needs it). Returns how
        many were captured."""
        if not self.use_graphs:
            return 0
        self.copy_done.synchronize()
        missing = [key for key in self.graph_keys() if key not in self.graphs]
        for key in missing:
            self.graphs[key] = self._capture(key)
        return len(missing)

    @torch.inference_mode()
    def measure_step_costs(self, replays: int = 5) -> None:
        """Time, once, the replay of each bucket's graphs of query length 1 and max_q (captured
        here, kept for the steps that need them) on padding inputs (no KV read or written), and
        interpolate the lengths between: the draft-length policy's step costs, fixed afterwards.
        At start-up, before any step: captures mid-run would cost more than the steps they time."""
        if not self.use_graphs:
            return
        ends = sorted({1, self.max_q})
        for b in self.buckets:
            measured = []
            for q in ends:
                key = (b, q)
                if key not in self.graphs:
                    self.graphs[key] = self._capture(key)
                self._stage_padding(key)
                graph = self.graphs[key][0]
                graph.replay()  # warm
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(replays):
                    graph.replay()
                end.record()
                end.synchronize()
                measured.append(start.elapsed_time(end) / 1e3 / replays)
            self.replay_seconds[b] = np.interp(np.arange(1, self.max_q + 1), ends, measured)

    # ---- one step -------------------------------------------------------------------------------
    def _views(self, key: tuple[int, int]):
        b, q, n, _ = graph_shape(key)
        T, R, r = self.T, self.row_cap, 2 * b
        d = self.dev64
        return (d[0:n], d[T:T + n], d[2 * T:2 * T + n], d[3 * T:3 * T + r], d[3 * T + R:3 * T + R + r + 1],
                self.dev32[:r])

    def _meta(self, key: tuple[int, int]) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor]:
        ids, pos, slots, ctx, qsl64, tables = self._views(key)
        qsl = qsl64.to(torch.int32)  # inside the graph: the step's own (ragged) row starts
        meta = AttentionMetadata(slot_mapping=slots, block_tables=tables, query_start_loc=qsl,
                                 context_lens=ctx.to(torch.int32), max_query_len=graph_shape(key)[1],
                                 max_context_len=self.width * self.block_size, block_size=self.block_size)
        return meta, ids, pos

    def _forward(self, key: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        b, q, n, prefill = graph_shape(key)
        meta, ids, pos = self._meta(key)
        if self.state_cache is None:
            hidden = self.model(ids, pos, meta, self.kv_caches)
        else:
            S = self.max_q
            state = StateMetadata(conv=self.state_cache.conv, ssm=self.state_cache.ssm,
                                  state_idx=self.dev_state[:2 * b, :S], num_accepted=self.dev_state[:2 * b, S],
                                  has_initial_state=self.dev_init[:2 * b], query_start_loc=meta.query_start_loc,
                                  num_decode_rows=2 * b, num_decode_tokens=n)
            hidden = self.model(ids, pos, meta, self.kv_caches, state=state)
        if prefill:  # the tokens _stage_logits names
            wanted = self.dev64[self.logits_at:self.logits_at + self.logits_slots(key)]
            return self.model.compute_logits(hidden.index_select(0, wanted)), hidden
        return self.model.compute_logits(hidden), hidden

    def _stage_padding(self, key: tuple[int, int]) -> None:
        """Device inputs of padding rows only (slot -1, context 0, PAD state slots): a forward on
        them writes no KV or state and reads none (graph warm-up, capture, timing)."""
        empty = np.zeros(0, dtype=np.int64)
        self._stage(key, 0, np.zeros(1, dtype=np.int32), empty, empty, empty, np.zeros(0, dtype=np.int32),
                    np.zeros((0, 0), dtype=np.int32))
        if key[1] < 0:
            self._stage_logits(key, empty)  # a stale list may name tokens past this graph's slots
        self.dev_bytes.copy_(self.host_bytes)
        if self.state_cache is not None:
            self.dev_state.copy_(self.host_state)  # PAD slots: live state stays untouched

    def _capture(self, key: tuple[int, int]) -> tuple[torch.cuda.CUDAGraph | None, tuple[torch.Tensor, torch.Tensor]]:
        with use_kernel_config(self.kernel_config):  # the engine's kernels, whoever calls
            self._stage_padding(key)  # the warm-up and the capture run on padding inputs
            return capture_graph(lambda: self._forward(key), self.device, self.pool)

    def _fill_state_padding(self, rows: int, padded_rows: int) -> None:
        """Hybrid models: padding rows [rows, 2b) get PAD state slots (no state read or written)."""
        self.np_state[rows:padded_rows, :-1] = -1
        self.np_state[rows:padded_rows, -1] = 1

    @torch.inference_mode()
    def launch_next(self, batch, key: tuple[int, int], token_ids: torch.Tensor,
                    tables: np.ndarray | None = None) -> PendingStep | None:
        """Launch the decode step that follows `batch` (decode rows, q = 1, replayed as `key`) as
        if every row continues: each row one position further (context + 1), in the block its
        table holds for that position (the same block, or the next one, which the scheduler
        reserved ahead: SchedulerConfig.decode_lookahead), its token from token_ids (this step's
        argmax, [rows] int64 on the device). tables: the rows' block tables as allocated (the
        scheduler's, with the blocks reserved ahead; None: the batch's, which stop at each row's
        context). None (nothing launched) when a row's table lacks the block of its next
        position: the scheduler allocates it next step, which cannot be predicted here."""
        b, q = key
        rows = len(batch.context_lens)
        if q != 1 or len(batch.input_ids) != rows or rows > b:
            return None
        first = np.asarray(batch.positions, dtype=np.int64) + 1
        # a copy: the batch's arrays are reused
        table = np.array(batch.block_tables if tables is None else tables, dtype=np.int32)
        return self._launch(key, np.array(batch.seq_ids), np.ones(rows, dtype=np.int32), None, first, table, token_ids)

    @torch.inference_mode()
    def launch_verify(self, seq_ids: np.ndarray, counts: np.ndarray, input_ids: np.ndarray, first: np.ndarray,
                      tables: np.ndarray) -> PendingStep | None:
        """Launch a decode/verify step given in full on the host (verify ahead: row i feeds
        counts[i] of input_ids, its tokens and drafts, from position first[i] on, in the blocks of
        its table), replayed as its bucket's graph. None (nothing launched) where no graph runs it
        or a row's table lacks a block."""
        key = self._key(len(seq_ids), counts)
        if key is None:
            return None
        return self._launch(key, seq_ids, counts, input_ids, first, tables)

    def _launch(self, key: tuple[int, int], seq_ids: np.ndarray, counts: np.ndarray, input_ids: np.ndarray | None,
                first: np.ndarray, table: np.ndarray, token_ids: torch.Tensor | None = None) -> PendingStep | None:
        """Stage and replay a step whose slots come from the rows' block tables (None where a
        position's block is missing or the step does not fit the graphs): _C.launch_rows."""
        if table.shape[1] > self.width or (self.use_graphs and key not in self.graphs):
            return None
        rows = _C.launch_rows(first, counts, table, self.block_size, self.width * self.block_size)
        if rows is None:
            return None
        qsl, pos, slots, ctx, num_blocks = rows
        n = int(qsl[-1])
        self._stage(key, len(seq_ids), qsl, input_ids, pos, slots, ctx, table)
        logits = self._run(key, n, token_ids)[:n]
        return PendingStep(key, logits, seq_ids, pos, slots, ctx, table, num_blocks, qsl, input_ids)

    @torch.inference_mode()
    def launch_built(self, key: tuple[int, int], tables: np.ndarray, built_rows: np.ndarray, build) -> torch.Tensor:
        """Replay `key` for a step whose inputs are written on the device (device_verify.py): the
        rows' block tables and built_rows (per row, what the building kernel reads: [rows,
        built_fields] int64, on the device at built_rows_device) are staged from the host in the
        step's one copy; build() runs on the stream after it and writes the rest of the static
        inputs (ids, positions, slots, context lengths and query starts, padding rows included).
        Returns the graph's logits, every token slot."""
        rows = len(built_rows)
        empty = np.zeros(0, dtype=np.int64)
        self._stage(key, rows, np.zeros(rows + 1, dtype=np.int32), None, empty, empty, np.zeros(rows, dtype=np.int32),
                    tables)
        self.np64[self.built_at:self.built_at + built_rows.size] = built_rows.ravel()
        return self._run(key, graph_shape(key)[2], before_replay=build)

    @property
    def built_rows_device(self) -> torch.Tensor:
        """launch_built's rows on the device: [max_rows, built_fields] int64."""
        return self.dev64[self.built_at:].view(self.max_rows, self.built_fields)

    @torch.inference_mode()
    def execute(self, batch, key: tuple[int, int],
                token_patch: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Logits of the step's logits_indices, in order (a decode/verify key: every token; a prefill
        key: the staged ones); last_hidden its hidden states. token_patch: ModelRunner.execute's."""
        m = len(batch.logits_indices)
        patch = () if token_patch is None else (token_patch,)
        logits = self._execute_part(batch, key, *patch)
        self.num_mixed += key[1] < 0
        return logits if m == len(logits) else logits[:m]

    def _execute_part(self, batch, key: tuple[int, int],
                      token_patch: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Stage a batch, capture its graph on first use, replay: the graph's static logits."""
        rows = len(batch.context_lens)
        self._stage(key, rows, batch.query_start_loc, batch.input_ids, batch.positions, batch.slot_mapping,
                    batch.context_lens, batch.block_tables)
        if key[1] < 0:
            self._stage_logits(key, batch.logits_indices)
        if self.state_cache is not None:
            self.np_state[:rows, :-1] = np.asarray(batch.state_slots, dtype=np.int32).reshape(rows, -1)
            self.np_state[:rows, -1] = np.maximum(np.asarray(batch.num_accepted_prev, dtype=np.int32), 1)
        if self.use_graphs and key not in self.graphs:
            self.graphs[key] = self._capture(key)
            return self._execute_part(batch, key, token_patch)  # _capture overwrote the staging padding
        return self._run(key, int(batch.query_start_loc[rows]), token_patch=token_patch)

    def _stage(self, key: tuple[int, int], rows: int, query_start_loc, input_ids, positions, slot_mapping,
               context_lens, block_tables) -> None:
        """A step's inputs into the host staging buffers (input_ids None: left as they are, the
        device copy of launch_next replaces them), with padding rows [rows, 2b) that own the token
        slots after the step's tokens, q at most each (then none), slot -1 (no KV write), context 0
        (no keys read) and PAD state slots: csrc/core/graph_staging.h."""
        if self.copy_done is not None:  # the previous step's copy has left the staging buffers
            self.copy_done.synchronize()
        b, q, slots, _ = graph_shape(key)
        _C.stage_graph_step(self.np64, self.np32, self.T, self.row_cap, 2 * b, q, slots, query_start_loc, input_ids,
                            positions, slot_mapping, context_lens, block_tables)
        if self.state_cache is not None:
            self._fill_state_padding(rows, 2 * b)

    def _run(self, key: tuple[int, int], n: int, token_ids: torch.Tensor | None = None,
             token_patch: tuple[torch.Tensor, torch.Tensor] | None = None, before_replay=None) -> torch.Tensor:
        """Copy the staged inputs to the device (then token_ids over the first ids, or token_patch's
        ids at its indices, device to device, or before_replay(), which writes inputs on the
        stream), run the step (its graph replayed, else eagerly) and
        return its logits (all the graph's: the caller keeps its rows'); last_hidden: the first n
        tokens' hidden states."""
        b = key[0]
        if self.use_graphs:
            host, dev = self.staged[b]
            if self.state_cache is not None:
                streams.copy_async(self.dev_state[:2 * b], self.host_state[:2 * b], self.device)
            streams.copy_async(dev, host, self.device, self.copy_done)
        else:
            self.dev_bytes.copy_(self.host_bytes)
            if self.state_cache is not None:
                self.dev_state.copy_(self.host_state)
        if token_ids is not None:
            streams.copy_async(self.dev64[0:len(token_ids)], token_ids, self.device)
        if token_patch is not None:
            self.dev64.index_copy_(0, *token_patch)
        if before_replay is not None:
            before_replay()
        if self.use_graphs:
            graph, (out, hidden) = self.graphs[key]
            graph.replay()
            self.num_replays += 1
        else:
            self.num_eager += 1
            out, hidden = self._forward(key)
        self.last_hidden = hidden[:n]  # static buffers: valid until the next replay
        return out
