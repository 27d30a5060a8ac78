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
from pyengine.spec_decode.draft_model import rows_batch
from pyengine.spec_decode.draft_sampling import DraftRow, DraftSampler


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

    @torch.inference_mode()
    def propose(self, scheduler: _C.Scheduler, view: _C.DecodeView, max_drafts: np.ndarray) -> None:
        self.sampler.pending.clear()
        hidden, rows_info = self.runner.last_hidden, self.runner.last_rows
        self.runner.last_hidden = self.runner.last_rows = None
        gone, self.gone = self.gone, set()
        if hidden is None or rows_info is None:
            return
        seq_ids, firsts, qsl = rows_info
        live = [r for r, sid in enumerate(seq_ids.tolist()) if sid not in gone]
        if not live:
            return
        ids = seq_ids[live]
        tails, offsets = scheduler.token_ids_from(ids, firsts[live] + 1)  # x_{first+1} onwards
        tables = scheduler.block_tables(ids)
        # Drafts wanted per decode row: k, the policy's cap, and room left (tokens and positions).
        view_ids = view.seq_ids.tolist()
        room = np.minimum(view.tokens_left, self.max_position - view.num_tokens) - 1
        wanted = dict(zip(view_ids, np.minimum(np.minimum(max_drafts, self.k), room).tolist()))

        feeds: list[tuple[np.ndarray, int, np.ndarray]] = []  # (block table, first position, tokens)
        hidden_index: list[np.ndarray] = []
        drafting: list[tuple[int, DraftRow, int]] = []  # (feed index, row, committed tokens n)
        for i, r in enumerate(live):
            sid, first = int(ids[i]), int(firsts[r])
            tail = tails[offsets[i]:offsets[i + 1]]
            n = first + 1 + len(tail)  # committed tokens
            start = max(first, self.valid.get(sid, 0))
            end = min(first + int(qsl[r + 1] - qsl[r]), n - 1)
            if start >= end:
                continue
            feeds.append((tables[i], start, tail[start - first:end - first]))
            hidden_index.append(np.arange(qsl[r] + start - first, qsl[r] + end - first))
            self.valid[sid] = end
            k = int(wanted.get(sid, 0))
            if k > 0 and end == n - 1:
                needed = -(-(n + k - 2) // self.block_size)  # positions up to n + k - 3
                assert needed <= (tables[i] >= 0).sum(), (f"request {sid}: MTP positions need {needed} blocks; is "
                                                          "SchedulerConfig.drafter_lookahead >= k?")
                drafting.append((len(feeds) - 1, DraftRow(sid, k, self.get_request(sid).params), n))
        if not feeds:
            return
        index = torch.from_numpy(np.concatenate(hidden_index)).to(hidden.device)
        out = self._forward(feeds, self.target_hidden(hidden.index_select(0, index)))
        if not drafting:
            return
        ends = np.cumsum([len(tokens) for _, _, tokens in feeds]) - 1  # each feed row's last token
        prev = out.index_select(0, torch.from_numpy(ends[[f for f, _, _ in drafting]]).to(out.device))
        rows = [row for _, row, _ in drafting]
        self.sampler.sample(rows, self.layer.compute_logits(prev))
        active = list(range(len(rows)))  # rows still drafting, aligned with prev
        for j in range(1, max(r.k for r in rows)):
            keep = [pos for pos, i in enumerate(active) if rows[i].k > j]
            active = [active[pos] for pos in keep]
            step_feeds = [(feeds[drafting[i][0]][0], drafting[i][2] - 2 + j, np.array([rows[i].drafts[j - 1]]))
                          for i in active]
            prev = self._forward(step_feeds, prev.index_select(0, torch.tensor(keep, device=prev.device)))
            self.sampler.sample([rows[i] for i in active], self.layer.compute_logits(prev))
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

    def _forward(self, feeds: list[tuple[np.ndarray, int, np.ndarray]], prev_hidden: torch.Tensor) -> torch.Tensor:
        """The MTP layer over varlen rows (block table, first position, tokens) with one hidden state
        per token -> its output for every token [T, hidden]."""
        batch = rows_batch(feeds, self.block_size)
        meta = self.runner.build_metadata(batch)
        input_ids = torch.from_numpy(batch.input_ids).to(self.device)
        positions = torch.from_numpy(batch.positions).to(self.device)
        self.num_forwards += 1
        return self.layer(input_ids, positions, prev_hidden, meta, self.kv_cache)

