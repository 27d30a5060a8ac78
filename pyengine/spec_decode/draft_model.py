"""Draft-model speculation: a smaller model with the target's vocabulary proposes k tokens per
running decode request by k sequential batched forwards; the target verifies them in one forward.

Draft KV cache
    The draft model owns its own paged KV tensors with the target's block geometry
    (num_kv_blocks x block_size) and writes the SAME slots as the target
    (block_table[p // B] * B + p % B, from scheduler.block_tables). There is no second allocator:
    the scheduler reserves `drafter_lookahead = k` extra positions per step, so the blocks the
    draft writes past the committed tokens were allocated by the previous step.

Per request, `valid` counts the leading positions whose draft KV is correct. A request the
proposer has not seen (new, or back after preemption) starts at 0: prefix-cache hits cover only
the target's cache, the draft's slots of a hit block may hold anything.
    propose(): forward 0 feeds positions [valid, n) (the catch-up: the whole sequence the first
    time, then usually 1-2 tokens) and samples draft 1 from the last position; forwards
    1..k-1 feed draft j at position n + j - 1 and sample draft j + 1. All requests share each
    forward (varlen rows).
    After verification, draft j's KV (position n + j - 1) is valid iff the committed token at
    that position equals draft j; the next propose() resolves `valid` from the committed tokens,
    so it needs no hook after verify. A preempted request (forget) starts at 0 again.

Per step the proposer reads from the scheduler, in one call each: the decode view (rows, token
counts, tokens left), each row's committed tokens from the first position it may need
(token_ids_from) and the block tables; the drafts go back in one set_draft_tokens_batch.

Sampling: greedy requests take the argmax of the draft logits; random requests sample from the
PROCESSED draft distribution q (the request's temperature/top-k/top-p/min-p) with a per-request
draft generator, and q is kept so the engine can pass draft_probs to the rejection sampler.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

from pyengine import _C
from pyengine.config import ModelConfig
from pyengine.engine.model_runner import ModelRunner
from pyengine.spec_decode.config import SpeculativeConfig
from pyengine.spec_decode.draft_sampling import DraftRow, DraftSampler
from pyengine.spec_decode.head_graphs import HeadFeed


@dataclass
class _SeqState:
    base: int  # num_tokens when the draft last ran: positions < base hold valid draft KV
    fed: list[int] = field(default_factory=list)  # draft inputs written at positions base, base + 1, ...

    def resolve(self, tail: Sequence[int]) -> int:
        """Leading positions with valid draft KV, given the committed tokens from base on."""
        valid = self.base
        for j, t in enumerate(self.fed):
            if j >= len(tail) or tail[j] != t:
                break
            valid += 1
        return valid


@dataclass
class _Row(DraftRow):
    n: int = 0  # committed tokens
    valid: int = 0
    catch_up: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))  # committed [valid, n): forward 0's inputs
    table: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))


def rows_batch(rows: Sequence[tuple[np.ndarray, int, Sequence[int]]], block_size: int) -> SimpleNamespace:
    """A proposer's own forward as a ScheduledBatch-like namespace: rows of (block_table, first
    position, input tokens), each writing its positions' slots of the target's block table and
    attending causally to everything before (HeadFeed.build's layout); logits at each row's last token."""
    tables = np.full((len(rows), max(len(t) for t, _, _ in rows)), -1, dtype=np.int32)
    for i, (table, _, _) in enumerate(rows):
        tables[i, :len(table)] = table
    lens = np.array([len(toks) for _, _, toks in rows], dtype=np.int64)
    starts = np.array([s for _, s, _ in rows], dtype=np.int64)
    input_ids = np.concatenate([np.asarray(toks, dtype=np.int64) for _, _, toks in rows])
    feed = HeadFeed.build(tables, starts, lens, block_size, input_ids)
    return SimpleNamespace(**vars(feed), logits_indices=(feed.query_start_loc[1:] - 1).astype(np.int64))


class DraftModelProposer:
    """Proposer protocol (see pyengine.spec_decode.proposer) plus draft_probs() for the rejection sampler.

    get_request(seq_id) returns a running request of the engine (needs .params).
    draft: an already loaded (model, ModelConfig); loaded from cfg.model when None.
    """

    def __init__(self, cfg: SpeculativeConfig, target_runner: ModelRunner, get_request: Callable[[int], Any],
                 seed: int, max_model_len: int, draft: Optional[tuple[torch.nn.Module, ModelConfig]] = None) -> None:
        self.k = cfg.num_speculative_tokens
        self.device, self.dtype = target_runner.device, target_runner.dtype
        if draft is None:
            from pyengine.loader import load_model

            model, draft_config, _ = load_model(cfg.model, str(self.device), self.dtype)
        else:
            model, draft_config = draft
        self.config = draft_config
        self.vocab = target_runner.config.vocab_size  # draft_probs columns = the target's vocabulary
        self.block_size = target_runner.block_size
        self.runner = ModelRunner(model, draft_config, self.block_size, target_runner.num_kv_blocks, self.device, self.dtype)
        self.get_request = get_request
        self.sampler = DraftSampler(seed, self.vocab, self.device)
        # Draft positions must stay inside the draft's rope table too.
        self.max_model_len = min(int(max_model_len), draft_config.max_position_embeddings)
        self.state: dict[int, _SeqState] = {}
        self.num_forwards = 0

    # ---- Proposer ----------------------------------------------------------------------------
    @property
    def drafting_module(self) -> Any:
        """What runs a forward per catch-up and per chained draft (the draft-length policy weighs it)."""
        return self.runner.model

    @torch.inference_mode()
    def propose(self, scheduler: _C.Scheduler, view: _C.DecodeView, max_drafts: np.ndarray) -> None:
        self.sampler.pending.clear()
        num_tokens = view.num_tokens
        # The scheduler's clamp (tokens left) and the draft's own position limit.
        useful = np.minimum(view.tokens_left, self.max_model_len - num_tokens) - 1
        ks = np.minimum(np.minimum(max_drafts, self.k), useful)
        picked = np.nonzero(ks > 0)[0]
        if not len(picked):
            return  # valid stays as is: the next catch-up covers the gap
        seq_ids = view.seq_ids[picked]
        states = [self.state.get(int(sid)) for sid in seq_ids]
        # Tokens from the first position each row may need: its draft state's base, else 0.
        starts = np.fromiter((0 if st is None or st.base > n else st.base
                              for st, n in zip(states, num_tokens[picked].tolist())), np.int64, len(picked))
        tails, offsets = scheduler.token_ids_from(seq_ids, starts)
        tables = scheduler.block_tables(seq_ids)
        table_lens = (tables >= 0).sum(axis=1)
        B = self.block_size
        rows: list[_Row] = []
        for i, (sid, n, k_r) in enumerate(zip(seq_ids.tolist(), num_tokens[picked].tolist(), ks[picked].tolist())):
            tail = tails[offsets[i]:offsets[i + 1]]
            start, st = int(starts[i]), states[i]
            valid = 0 if st is None or st.base > n else min(st.resolve(tail), n - 1)
            # The draft writes positions up to n - 1 + (k_r - 1) before this step's append: the previous
            # step's allocation (drafter_lookahead = k) must already cover them.
            needed = -(-(n + k_r - 1) // B)
            assert needed <= table_lens[i], (f"request {sid}: draft positions need {needed} blocks, the table has "
                                             f"{table_lens[i]}; is SchedulerConfig.drafter_lookahead >= k?")
            rows.append(_Row(sid, k_r, self.get_request(sid).params, n=n, valid=valid, catch_up=tail[valid - start:],
                             table=tables[i, :table_lens[i]]))

        # Forward 0: catch up [valid, n), sample draft 1 from the last position.
        logits = self._forward([(r.table, r.valid, r.catch_up) for r in rows])
        self.sampler.sample(rows, logits)
        for j in range(1, max(r.k for r in rows)):
            live = [r for r in rows if r.k > j]
            logits = self._forward([(r.table, r.n + j - 1, [r.drafts[j - 1]]) for r in live])
            self.sampler.sample(live, logits)

        self.sampler.keep(rows)
        for r in rows:
            self.state[r.seq_id] = _SeqState(base=r.n, fed=r.drafts[:-1])
        scheduler.set_draft_tokens_batch(seq_ids, np.fromiter((t for r in rows for t in r.drafts), np.int32),
                                         np.fromiter((len(r.drafts) for r in rows), np.int32, len(rows)))

    def forget(self, seq_ids: Sequence[int], finished: bool) -> None:
        """Preempted requests lose their draft KV (their blocks were freed); finished ones also
        their draft generator."""
        for sid in seq_ids:
            self.state.pop(int(sid), None)
        self.sampler.forget(seq_ids, finished)

    def draft_probs(self, seq_ids: Sequence[int], num_draft_tokens: Sequence[int]) -> Optional[torch.Tensor]:
        """q rows for the rejection sampler (DraftSampler.draft_probs)."""
        return self.sampler.draft_probs(seq_ids, num_draft_tokens)

    # ---- internals ------------------------------------------------------------------------------
    def _forward(self, rows: list[tuple[np.ndarray, int, Sequence[int]]]) -> torch.Tensor:
        """rows: (block_table, first position, input tokens). Logits [R, V] at each row's last token."""
        self.num_forwards += 1
        return self._fit_vocab(self.runner.execute(rows_batch(rows, self.block_size)))

    def _fit_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits over the target's vocabulary: extra draft ids are never proposed, missing
        ones get probability 0."""
        v = logits.shape[-1]
        if v > self.vocab:
            return logits[:, :self.vocab]
        if v < self.vocab:
            pad = torch.full((logits.shape[0], self.vocab - v), float("-inf"), dtype=logits.dtype, device=logits.device)
            return torch.cat([logits, pad], dim=1)
        return logits
