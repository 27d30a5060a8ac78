"""MTP speculation (`speculative_config={"method": "mtp", "num_speculative_tokens": k}`): the target
model's own multi-token-prediction layer (model.mtp: DeepSeek-V3's, Qwen3-Next's) proposes k drafts
per running decode request from the target's hidden states.

The MTP layer at position p reads the token x_{p+1} and the target's final hidden state h_p, and
predicts x_{p+2}; its latent/KV cache is indexed by the target's slots (one more layer sharing the
block tables). Per request, `valid` counts the leading positions whose MTP cache entry was computed
from the target's hidden state and committed tokens.

propose(), before schedule():
  catch-up  for every row of the target's previous step (prefill chunks included), the positions
            p in [max(first, valid), n - 1) whose hidden state that step computed and whose next
            token x_{p+1} is committed (n = committed tokens): all of a prefill chunk but its
            prompt's last position, and a verify row's accepted run; one varlen forward for all.
            The last output of a decode row (p = n - 2) gives its draft 1.
  drafts    draft j + 1 feeds draft j at position n - 2 + j with the layer's own previous output
            as the hidden state (the target has not seen x_{n-1} yet), j = 1..k-1.
  valid     becomes n - 1: the draft positions' entries are rewritten by the next catch-up.
Those writes reach position n + k - 3, inside the blocks the previous step reserved
(SchedulerConfig.drafter_lookahead = k): no allocation happens inside the draft loop.
Positions the target did not compute (a prefix-cache hit) are skipped: their MTP entries are
whatever the block's earlier owner wrote, or zeros. That changes drafts only, never the output.

Where the target replays CUDA graphs, so do the layer's forwards whose rows feed at most k + 1
tokens each (decode catch-ups, chained drafts): pyengine/spec_decode/head_graphs.py; prefill
catch-ups run eagerly. The chained drafts stay on the device until all are drawn (one host sync).

An EAGLE-3 head (pyengine/spec_decode/eagle3.py) drafts the same way: `layer` is any module with
make_kv_cache, forward(ids, positions, prev_hidden, meta, kv_cache) and compute_logits, and
target_hidden maps the target's kept states to the layer's prev_hidden for the catch-up.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
import torch

from pyengine import _C
from pyengine.engine.model_runner import ModelRunner
from pyengine.spec_decode.config import SpeculativeConfig
from pyengine.spec_decode.draft_sampling import DraftRow, DraftSampler
from pyengine.spec_decode.head_graphs import HeadFeed, HeadGraphs


class MtpProposer:
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
        self.valid: dict[int, int] = {}
        self.gone: set[int] = set()  # forgotten since the target's last step: its rows there are stale
        self.sampler = DraftSampler(seed, runner.config.vocab_size, runner.device)
        self.num_forwards = 0
        g = runner.graph_runner  # the target replays graphs: the layer's short forwards do too
        self.graphs: HeadGraphs | None = None
        if g is not None and getattr(self.layer, "supports_cuda_graphs", True):
            self.set_graphs(HeadGraphs(self.layer, self.kv_cache, self.block_size, self.device, g.max_rows, g.max_q,
                                       g.width * self.block_size))

    def set_graphs(self, graphs: HeadGraphs | None) -> None:
        """Run the layer's short forwards (decode catch-ups, chained drafts) through these graphs
        (None: all eager). On a CPU device the graphs' static-buffer path runs eagerly (tests)."""
        self.graphs = graphs

    @torch.inference_mode()
    def propose(self, scheduler: _C.Scheduler, view: _C.DecodeView, max_drafts: np.ndarray) -> None:
        self.sampler.pending.clear()
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
        tails, offsets = scheduler.token_ids_from(ids, first + 1)  # x_{first+1} onwards
        n = first + 1 + np.diff(offsets)  # committed tokens
        valid = np.fromiter((self.valid.get(s, 0) for s in ids.tolist()), np.int64, len(ids))
        start = np.maximum(first, valid)
        end = np.minimum(first + np.diff(qsl)[live], n - 1)
        fed = np.flatnonzero(start < end)  # rows with a catch-up, in the target's row order
        if not len(fed):
            return
        self.valid.update(zip(ids[fed].tolist(), end[fed].tolist()))
        tables = scheduler.block_tables(ids[fed])
        lens = end[fed] - start[fed]
        # token t of feed row i sits at position p: x_{p+1} is tails[offsets[i] + p - first[i]], and
        # the target's state of p is hidden row row_start[i] + p - first[i]
        row = np.repeat(fed, lens)
        within = np.arange(int(lens.sum())) - np.repeat(np.cumsum(lens) - lens, lens)
        rel = start[row] - first[row] + within
        feed = HeadFeed.build(tables, start[fed], lens, self.block_size, tails[offsets[:-1][row] + rel].astype(np.int64))
        index = torch.from_numpy(row_start[row] + rel).to(hidden.device)

        # Drafts wanted per decode row: k, the policy's cap, and room left (tokens and positions).
        room = np.minimum(view.tokens_left, self.max_position - view.num_tokens) - 1
        wanted = dict(zip(view.seq_ids.tolist(), np.minimum(np.minimum(max_drafts, self.k), room).tolist()))
        ks = np.fromiter((wanted.get(s, 0) for s in ids[fed].tolist()), np.int64, len(fed))
        d = np.flatnonzero((ks > 0) & (end[fed] == n[fed] - 1))  # drafting feed rows
        if len(d):
            needed = -(-(n[fed][d] + ks[d] - 2) // self.block_size)  # positions up to n + k - 3
            have = (tables[d] >= 0).sum(axis=1)
            assert (needed <= have).all(), (f"requests {ids[fed][d][needed > have]}: MTP positions need more blocks; "
                                            "is SchedulerConfig.drafter_lookahead >= k?")
        out, logits = self._forward(feed, self.target_hidden(hidden.index_select(0, index)), d)
        if not len(d):
            return
        rows = [DraftRow(sid, k, self.get_request(sid).params) for sid, k in zip(ids[fed][d].tolist(), ks[d].tolist())]
        ends = feed.query_start_loc[1:].astype(np.int64)[d] - 1  # each drafting row's last token
        prev = out.index_select(0, torch.from_numpy(ends).to(out.device))
        tokens = [self.sampler.draw(rows, logits)]
        chain_tables, pos = tables[d], n[fed][d] - 2  # draft j + 1 feeds draft j at position n - 2 + j
        active = np.arange(len(rows))  # rows still drafting, aligned with prev and tokens[-1]
        actives = [active]
        for j in range(1, int(ks[d].max())):
            keep = np.flatnonzero(ks[d][active] > j)
            ids_j = tokens[-1]
            if len(keep) < len(active):  # some rows stop here (their k): drop their rows
                keep_t = torch.from_numpy(keep).to(prev.device)
                prev, ids_j = prev.index_select(0, keep_t), ids_j.index_select(0, keep_t)
            active = active[keep]
            actives.append(active)
            step = HeadFeed.build(chain_tables[active], pos[active] + j, np.ones(len(active), np.int64),
                                  self.block_size)
            prev, logits = self._forward(step, prev, np.arange(len(active)), token_ids=ids_j)
            tokens.append(self.sampler.draw([rows[i] for i in active], logits))
        drafted = torch.cat(tokens).tolist()  # the one host sync of the drafts
        at = 0
        for active in actives:
            for i in active.tolist():
                rows[i].drafts.append(drafted[at])
                at += 1
        self.sampler.keep(rows)
        scheduler.set_draft_tokens_batch(np.array([r.seq_id for r in rows], dtype=np.int64),
                                         np.fromiter((t for r in rows for t in r.drafts), np.int32),
                                         np.fromiter((len(r.drafts) for r in rows), np.int32, len(rows)))

    def forget(self, seq_ids: Sequence[int], finished: bool) -> None:
        for sid in seq_ids:
            self.valid.pop(int(sid), None)
            self.gone.add(int(sid))
        self.sampler.forget(seq_ids, finished)

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
            return out, logits.index_select(0, torch.from_numpy(logit_rows).to(logits.device))
        meta = self.runner.build_metadata(feed)
        if token_ids is None:
            token_ids = torch.from_numpy(feed.input_ids).to(self.device)
        positions = torch.from_numpy(feed.positions).to(self.device)
        out = self.layer(token_ids, positions, prev_hidden, meta, self.kv_cache)
        if not len(logit_rows):
            return out, out.new_empty(0)
        last = torch.from_numpy(feed.query_start_loc[1:].astype(np.int64)[logit_rows] - 1).to(out.device)
        return out, self.layer.compute_logits(out.index_select(0, last))
