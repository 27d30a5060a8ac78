"""MTP speculation (`speculative_config={"method": "mtp", "num_speculative_tokens": k}`): the target
model's own multi-token-prediction layer (model.mtp: DeepSeek-V3's, Qwen3-Next's) proposes k drafts
per running decode request from the target's hidden states.

The MTP layer at position p reads the token x_{p+1} and the target's final hidden state h_p, and
predicts x_{p+2}; its latent/KV cache is indexed by the target's slots (one more layer sharing the
block tables). Per request, `valid` counts the leading positions whose MTP cache entry was computed
from the target's hidden state and committed tokens.

propose(), before schedule():
  catch-up  for the rows of the target's previous step (prefill chunks included), the positions
            p in [valid, n - 1) whose hidden state the target computed and whose next token
            x_{p+1} is committed (n = committed tokens): all of a prefill chunk but its prompt's
            last position, and a verify row's accepted run; one varlen forward for all.
            The last output of a decode row (p = n - 2) gives its draft 1.
  deferral  a row that drafts nothing this step (the draft-length policy's 0) skips its catch-up
            and keeps the step's hidden states in a ring (HiddenRing, RING_POSITIONS a row) until
            the first step it drafts in: steps without drafts run no layer forward, and the
            layer's entries are the same, only computed later (tests/test_lazy_catch_up.py). A
            quiet spell longer than the ring holds (`slide`) keeps its latest positions and skips
            the older ones, as a prefix-cache hit is skipped: their entries stay stale, which can
            change drafts only, and a row that never drafts costs no layer work at all. (slide
            False: the spell forces a catch-up, which every deferred row past half the ring joins;
            on a 2-core Xeon, EAGLE-3 batch 1, a step without drafts cost 0.36 ms over plain's
            sliding, 1.04 ms forcing, acceptance 0.542 / 0.541.)
  drafts    draft j + 1 feeds draft j at position n - 2 + j with the layer's own previous output
            as the hidden state (the target has not seen x_{n-1} yet), j = 1..k-1.
  valid     becomes n - 1: the draft positions' entries are rewritten by the next catch-up.
Those writes reach position n + k - 3, inside the blocks the previous step reserved
(SchedulerConfig.drafter_lookahead = k): no allocation happens inside the draft loop.
Positions the target did not compute (a prefix-cache hit) are skipped: their MTP entries are
whatever the block's earlier owner wrote, or zeros. That changes drafts only, never the output.

Where the target replays CUDA graphs, so do the layer's catch-ups (deferred ones and prompts too,
up to CATCH_UP_GRAPH_TOKENS tokens in a step) and chained drafts: pyengine/spec_decode/head_graphs.py;
longer catch-ups run eagerly. The drafts stay on the device until the verify step is launched
(pyengine/spec_decode/device_drafts.py): propose() gives the scheduler placeholders and never waits.

An EAGLE-3 head (pyengine/spec_decode/eagle3.py) drafts the same way: `layer` is any module with
make_kv_cache, forward(ids, positions, prev_hidden, meta, kv_cache) and compute_logits, and
target_hidden maps the target's kept states to the layer's prev_hidden for the catch-up.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
import torch

from pyengine import _C
from pyengine.engine.host_arrays import index_of, to_device
from pyengine.engine.model_runner import ModelRunner
from pyengine.engine.prefill_graphs import PREFILL_GRAPH_TOKENS
from pyengine.spec_decode.config import SpeculativeConfig
from pyengine.spec_decode.device_drafts import PLACEHOLDER, DeviceDrafts
from pyengine.spec_decode.draft_chain import DraftChain
from pyengine.spec_decode.draft_sampling import DraftRow, DraftSampler
from pyengine.spec_decode.head_graphs import HeadFeed, HeadGraphs
from pyengine.spec_decode.hidden_ring import HiddenRing
from pyengine.spec_decode.seq_columns import SeqColumns


class MtpProposer:
    RING_POSITIONS = 64  # positions a row may leave un-caught-up (HiddenRing)
    # catch-ups longer than a verify row replay graphs up to this many tokens: at least the target's
    # prefill graphs' (a prompt that fits one needs no eager forward of the layer) and what 64 rows
    # catching up a full ring each feed (a probe step at batch 64: ~3100 tokens had run eagerly)
    CATCH_UP_GRAPH_TOKENS = max(PREFILL_GRAPH_TOKENS, 64 * RING_POSITIONS)

    def __init__(self, cfg: SpeculativeConfig, runner: ModelRunner, get_request: Callable[[int], Any], seed: int,
                 max_model_len: int, layer: Any = None) -> None:
        """layer: the drafting layer (default: the target's own MTP layer, runner.model.mtp)."""
        self.layer = layer if layer is not None else getattr(runner.model, "mtp", None)
        if self.layer is None:
            raise ValueError(f"{runner.config.architecture}: speculative method 'mtp' needs the model's MTP layers "
                             "(load the model with load_mtp=True)")
        self.k, self.runner, self.get_request = cfg.num_speculative_tokens, runner, get_request
        self.block_size, self.device = runner.block_size, runner.device
        runner.keep_hidden = True
        self.kv_cache = self.layer.make_kv_cache(runner.num_kv_blocks, runner.block_size, runner.device)
        self.max_position = runner.config.max_position_embeddings
        self.valid = SeqColumns()  # per request: positions before this one are in the layer's cache
        self.gone: set[int] = set()  # forgotten since the target's last step: its rows there are stale
        self.sampler = DraftSampler(seed, runner.config.vocab_size, runner.device)
        self.device_drafts = DeviceDrafts(runner.device)  # this step's drafts, read after the verify launch
        self.num_forwards = 0
        # hidden states of rows that deferred their catch-up (steps without drafts run no forward)
        self.ring = HiddenRing(self.RING_POSITIONS, runner.device)
        self.lazy = True  # False: every row catches up every step (tests compare the two)
        self.slide = True  # False: a quiet spell longer than the ring forces a catch-up (module docstring)
        g = runner.graph_runner  # the target replays graphs: the layer's short forwards do too
        self.graphs: HeadGraphs | None = None
        self.chain: DraftChain | None = None
        if g is not None and getattr(self.layer, "supports_cuda_graphs", True):
            self.set_graphs(HeadGraphs(self.layer, self.kv_cache, self.block_size, self.device, g.max_rows, g.max_q,
                                       g.width * self.block_size, catch_up_tokens=self.CATCH_UP_GRAPH_TOKENS,
                                       prev_width=self._input_width()))

    @property
    def drafting_module(self) -> Any:
        """What runs a forward per catch-up and per chained draft (the draft-length policy weighs it)."""
        return self.layer

    def set_graphs(self, graphs: HeadGraphs | None) -> None:
        """Run the layer's short forwards (decode catch-ups, chained drafts) through these graphs,
        and greedy rows' chained drafts through one DraftChain replay (None: all eager, step by
        step). On a CPU device the static-buffer paths run eagerly (tests)."""
        self.graphs = graphs
        self.chain = None
        if graphs is not None and self.k > 1:
            self.chain = DraftChain(self.layer, self.kv_cache, self.block_size, self.device, graphs.buckets,
                                    graphs.width, self.k - 1, self._input_width(), graphs.pool)

    def capture_graphs(self, loop_rows: int = 0) -> int:
        """Capture the layer's graphs up front (start-up, beside the target's capture_all): catch-ups
        of every bucket and length, chains of every depth (and the device loop's, up to loop_rows
        rows). Else each is captured on first use, inside the step that needs it: at batch 64 five
        such captures cost ~32 ms of a 0.81 s Spec-Bench run (H100). Returns how many."""
        if self.graphs is None:
            return 0
        return self.graphs.capture_all() + (self.chain.capture_all(loop_rows) if self.chain is not None else 0)

    def _input_width(self) -> tuple[int, torch.dtype]:
        """(width, dtype) of the layer's input states: an EAGLE-3 head's own width, an MTP layer's the target's."""
        width = getattr(getattr(self.layer, "config", None), "hidden_size", self.runner.config.hidden_size)
        return width, self.layer.dtype

    @torch.inference_mode()
    def propose(self, scheduler: _C.Scheduler, view: _C.DecodeView, max_drafts: np.ndarray) -> None:
        self.sampler.pending.clear()
        self.device_drafts.clear()
        hidden, rows_info = self.runner.last_hidden, self.runner.last_rows
        self.runner.last_hidden = self.runner.last_rows = None
        gone, self.gone = self.gone, set()
        if hidden is None or rows_info is None:
            return
        seq_ids, firsts, qsl = rows_info
        live = ~np.isin(seq_ids, np.fromiter(gone, np.int64, len(gone))) if gone else np.ones(len(seq_ids), bool)
        if not live.any():
            return
        ids, first = seq_ids[live], firsts[live].astype(np.int64)
        row_start = qsl[:-1][live].astype(np.int64)
        valid = self.valid.get(ids)
        held = self.ring.held_from(ids, first)  # positions before: not computed by the target (prefix hit)
        start = np.maximum(held, valid)
        lo = np.minimum(start, first)
        tails, offsets = scheduler.token_ids_from(ids, lo + 1)  # x_{lo+1} onwards
        n = lo + 1 + np.diff(offsets)  # committed tokens
        end = np.minimum(first + np.diff(qsl)[live], n - 1)
        # Drafts wanted per decode row: k, the policy's cap, and room left (tokens and positions).
        room = np.minimum(view.tokens_left, self.max_position - view.num_tokens) - 1
        caps = np.append(np.minimum(np.minimum(max_drafts, self.k), room), 0).astype(np.int64)
        ks_all = caps[index_of(np.asarray(view.seq_ids, dtype=np.int64), ids)]  # index -1 (a prefill row): 0
        # A row that drafts nothing now defers its catch-up (module docstring): sliding, it keeps at
        # most ring_room positions (room for one more step's); else while they fit, and when some row
        # catches up anyway, rows past half the ring join its forward (one forward for many).
        pending, ring_room = end - start, self.ring.size - (self.k + 1)
        if self.lazy and self.slide:
            # a quiet row keeps its latest ring_room positions; older ones are skipped (module docstring)
            defer = (ks_all <= 0) & (pending > 0) & (end - first <= ring_room)
            start = np.where(defer & (pending > ring_room), end - ring_room, start)
        else:
            defer = (ks_all <= 0) & (pending > 0) & (pending <= ring_room) if self.lazy else \
                np.zeros(len(ids), dtype=bool)
            if ((pending > 0) & ~defer).any():
                defer &= pending < self.ring.size // 2
        if defer.any():
            keep = np.flatnonzero(defer & (end > first))
            self.ring.keep(ids[keep], start[keep], first[keep], end[keep], row_start[keep], hidden)
        fed = np.flatnonzero((pending > 0) & ~defer)  # rows with a catch-up now, in the target's row order
        if not len(fed):
            return
        self.valid.set(ids[fed], end[fed])
        tables = scheduler.block_tables(ids[fed])
        lens = end[fed] - start[fed]
        # token t of feed row i sits at position p: x_{p+1} is tails[offsets[i] + p - lo[i]]; the
        # target's state of p is hidden row row_start[i] + p - first[i] if this step computed p,
        # else the ring's
        row = np.repeat(fed, lens)
        pos = start[row] + np.arange(int(lens.sum())) - np.repeat(np.cumsum(lens) - lens, lens)
        feed = HeadFeed.build(tables, start[fed], lens, self.block_size,
                              tails[offsets[:-1][row] + pos - lo[row]].astype(np.int64))
        prev = self._catch_up_hidden(hidden, ids[row], pos, first[row], row_start[row])
        self.ring.release(ids[fed])
        ks = ks_all[fed]
        d = np.flatnonzero((ks > 0) & (end[fed] == n[fed] - 1))  # drafting feed rows
        if len(d):
            needed = -(-(n[fed][d] + ks[d] - 2) // self.block_size)  # positions up to n + k - 3
            have = (tables[d] >= 0).sum(axis=1)
            assert (needed <= have).all(), (f"requests {ids[fed][d][needed > have]}: MTP positions need more blocks; "
                                            "is SchedulerConfig.drafter_lookahead >= k?")
        out, logits = self._forward(feed, self.target_hidden(prev), d)
        if not len(d):
            return
        rows = [DraftRow(sid, k, self.get_request(sid).params) for sid, k in zip(ids[fed][d].tolist(), ks[d].tolist())]
        ends = feed.query_start_loc[1:].astype(np.int64)[d] - 1  # each drafting row's last token
        prev = out.index_select(0, to_device(ends, out.device))
        tokens = [self.sampler.draw(rows, logits)]
        chain_tables, pos = tables[d], n[fed][d] - 2  # draft j + 1 feeds draft j at position n - 2 + j
        counts = ks[d]
        steps = int(counts.max()) - 1
        if (steps > 0 and self.chain is not None and all(r.params.is_greedy for r in rows)
                and self.chain.fits(len(rows), chain_tables, steps)):
            # one replay for drafts 2..; row i's draft j is entry j * rows + i of [draft 1 | the chain's]
            drawn = self.chain.run(chain_tables, pos + 1, counts - 1, tokens[0], prev)
            flat = torch.cat([tokens[0], drawn.reshape(-1)])
            self.num_forwards += steps
            j = np.arange(steps + 1)
            row_major = (j[None, :] * len(rows) + np.arange(len(rows))[:, None])[j[None, :] < counts[:, None]]
        else:
            flat, row_major = self._chain_steps(rows, counts, chain_tables, pos, prev, tokens)
        # the drafts stay on the device (device_drafts.py)
        values = flat.index_select(0, to_device(row_major, self.device))
        self.device_drafts.hold(ids[fed][d], counts, values)
        for r, c in zip(rows, counts.tolist()):
            r.drafts = [PLACEHOLDER] * c
        self.sampler.keep(rows)
        scheduler.set_draft_tokens_batch(ids[fed][d], np.full(int(counts.sum()), PLACEHOLDER, np.int32),
                                         counts.astype(np.int32))

    def _chain_steps(self, rows: list[DraftRow], counts: np.ndarray, tables: np.ndarray, pos: np.ndarray,
                     prev: torch.Tensor, tokens: list[torch.Tensor]) -> tuple[torch.Tensor, np.ndarray]:
        """Drafts 2.. step by step from the host (random rows keep each draft's q): the drafts
        flat in step order, and the index that orders them row after row."""
        active = np.arange(len(rows))  # rows still drafting, aligned with prev and tokens[-1]
        actives = [active]
        for j in range(1, int(counts.max())):
            keep = np.flatnonzero(counts[active] > j)
            ids_j = tokens[-1]
            if len(keep) < len(active):  # some rows stop here (their k): drop their rows
                keep_t = to_device(keep, prev.device)
                prev, ids_j = prev.index_select(0, keep_t), ids_j.index_select(0, keep_t)
            active = active[keep]
            actives.append(active)
            step = HeadFeed.build(tables[active], pos[active] + j, np.ones(len(active), np.int64), self.block_size)
            prev, logits = self._forward(step, prev, np.arange(len(active)), token_ids=ids_j)
            tokens.append(self.sampler.draw([rows[i] for i in active], logits))
        pair_row = np.concatenate(actives)
        pair_step = np.repeat(np.arange(len(actives)), [len(a) for a in actives])
        return torch.cat(tokens), np.lexsort((pair_step, pair_row))

    @torch.inference_mode()
    def catch_up_held(self, scheduler: _C.Scheduler, seq_ids: np.ndarray, first: np.ndarray) -> None:
        """The positions before first[i] that row i deferred (held in the ring), caught up now:
        each row's layer entries then run up to its first position (the device loop's catch-up
        covers the step from there: layer_device_drafts.py). Positions neither caught up nor held
        (a prefix-cache hit) are skipped, as propose skips them."""
        start = np.maximum(self.ring.held_from(seq_ids, first), self.valid.get(seq_ids))
        fed = np.flatnonzero(start < first)
        if len(fed):
            ids, lo, lens = seq_ids[fed], start[fed], first[fed] - start[fed]
            tails, offsets = scheduler.token_ids_from(ids, lo + 1)  # x_{p+1} for p in [lo, first)
            assert np.array_equal(np.diff(offsets), lens), "a held position's next token is not committed"
            row = np.repeat(np.arange(len(fed)), lens)
            pos = lo[row] + np.arange(int(lens.sum())) - np.repeat(np.cumsum(lens) - lens, lens)
            feed = HeadFeed.build(scheduler.block_tables(ids), lo, lens, self.block_size, tails.astype(np.int64))
            self._forward(feed, self.target_hidden(self.ring.gather(ids[row], pos)), np.zeros(0, np.int64))
        self.caught_up(seq_ids, first)
        self.ring.release(seq_ids)

    def caught_up(self, seq_ids: np.ndarray, ends: np.ndarray) -> None:
        """The layer's entries of these rows now run up to ends (exclusive): a catch-up queued by
        catch_up_held or by the device loop (LayerDeviceDrafts.adopt)."""
        self.valid.set(seq_ids, ends)

    def forget(self, seq_ids: Sequence[int], finished: bool) -> None:
        self.valid.drop(seq_ids)
        self.gone.update(int(s) for s in seq_ids)
        self.ring.drop(seq_ids)
        self.sampler.forget(seq_ids, finished)

    def _catch_up_hidden(self, hidden: torch.Tensor, seq_ids: np.ndarray, pos: np.ndarray, first: np.ndarray,
                         row_start: np.ndarray) -> torch.Tensor:
        """The target's state of each catch-up token (request seq_ids[t] at position pos[t]): this
        step's hidden row where the step computed it (pos >= first), else the ring's."""
        here = pos >= first
        if here.all():
            return hidden.index_select(0, to_device(row_start + pos - first, hidden.device))
        out = hidden.new_empty(len(pos), hidden.shape[1])
        at = np.flatnonzero(here)
        if len(at):
            out.index_copy_(0, to_device(at, out.device),
                            hidden.index_select(0, to_device(row_start[at] + pos[at] - first[at], hidden.device)))
        older = np.flatnonzero(~here)
        out.index_copy_(0, to_device(older, out.device), self.ring.gather(seq_ids[older], pos[older]))
        return out

    def draft_probs(self, seq_ids: Sequence[int], num_draft_tokens: Sequence[int]) -> torch.Tensor | None:
        return self.sampler.draft_probs(seq_ids, num_draft_tokens)

    def target_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's kept states of the catch-up positions -> the layer's prev_hidden (MTP: as is)."""
        return hidden

    def _forward(self, feed: HeadFeed, prev_hidden: torch.Tensor, logit_rows: np.ndarray,
                 token_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer over the feed's rows with one hidden state per token -> its output for every
        token [T, hidden] and the logits of rows logit_rows' last tokens. Replayed from a graph where
        the rows fit one (every row at most max_q tokens), else eager. token_ids: the feed's tokens
        on the device (then feed.input_ids is None)."""
        self.num_forwards += 1
        key = self.graphs.key_for(feed) if self.graphs is not None else None
        if key is not None:
            out, logits = self.graphs.run(key, feed, prev_hidden, token_ids)
            if len(logit_rows) == len(logits):  # every row (the chained steps): no gather
                return out, logits
            return out, logits.index_select(0, to_device(logit_rows, logits.device))
        meta = self.runner.build_metadata(feed)
        if token_ids is None:
            token_ids = to_device(feed.input_ids, self.device)
        positions = to_device(feed.positions, self.device)
        out = self.layer(token_ids, positions, prev_hidden, meta, self.kv_cache)
        if not len(logit_rows):
            return out, out.new_empty(0)
        last = to_device(feed.query_start_loc[1:].astype(np.int64)[logit_rows] - 1, out.device)
        return out, self.layer.compute_logits(out.index_select(0, last))
