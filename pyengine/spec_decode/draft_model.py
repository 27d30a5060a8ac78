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
from pyengine.engine.sampler import SamplingTensors, compute_probs, derive_seed, draw_uniforms, sample_from_probs
from pyengine.spec_decode.config import SpeculativeConfig


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
class _Row:
    seq_id: int
    n: int  # committed tokens
    valid: int
    catch_up: np.ndarray  # committed tokens [valid, n): forward 0's inputs
    table: np.ndarray
    k: int
    params: Any
    drafts: list[int] = field(default_factory=list)
    q: list[torch.Tensor] = field(default_factory=list)


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
        num_kv_blocks = target_runner.kv_caches[0][0].shape[0]
        self.runner = ModelRunner(model, draft_config, self.block_size, num_kv_blocks, self.device, self.dtype)
        self.get_request = get_request
        self.seed = int(seed)
        # Draft positions must stay inside the draft's rope table too.
        self.max_model_len = min(int(max_model_len), draft_config.max_position_embeddings)
        self.state: dict[int, _SeqState] = {}
        self.generators: dict[int, torch.Generator] = {}
        self.pending: dict[int, tuple[list[int], Optional[torch.Tensor]]] = {}  # this step's drafts and q
        self.num_forwards = 0

    # ---- Proposer ----------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, scheduler: _C.Scheduler, view: _C.DecodeView, max_drafts: np.ndarray) -> None:
        self.pending.clear()
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
            rows.append(_Row(sid, n, valid, tail[valid - start:], tables[i, :table_lens[i]], k_r,
                             self.get_request(sid).params))

        # Forward 0: catch up [valid, n), sample draft 1 from the last position.
        logits = self._forward([(r.table, r.valid, r.catch_up) for r in rows])
        self._sample(rows, logits)
        for j in range(1, max(r.k for r in rows)):
            live = [r for r in rows if r.k > j]
            logits = self._forward([(r.table, r.n + j - 1, [r.drafts[j - 1]]) for r in live])
            self._sample(live, logits)

        for r in rows:
            self.pending[r.seq_id] = (r.drafts, torch.stack(r.q) if r.q else None)
            self.state[r.seq_id] = _SeqState(base=r.n, fed=r.drafts[:-1])
        scheduler.set_draft_tokens_batch(seq_ids, np.fromiter((t for r in rows for t in r.drafts), np.int32),
                                         np.fromiter((len(r.drafts) for r in rows), np.int32, len(rows)))

    def forget(self, seq_ids: Sequence[int], finished: bool) -> None:
        """Preempted requests lose their draft KV (their blocks were freed); finished ones also
        their draft generator."""
        for sid in seq_ids:
            self.state.pop(int(sid), None)
            if finished:
                self.generators.pop(int(sid), None)

    # ---- for the rejection sampler ------------------------------------------------------------
    def draft_probs(self, seq_ids: Sequence[int], num_draft_tokens: Sequence[int]) -> Optional[torch.Tensor]:
        """[sum d, V] rows of q aligned with the drafts scheduled this step (row order; each row's
        first d drafts, d <= proposed: the scheduler may trim). None when no random row has drafts
        (greedy rows ignore q; their rows here are zeros)."""
        parts: list[torch.Tensor] = []
        any_random = False
        for sid, d in zip(seq_ids, num_draft_tokens):
            d = int(d)
            if d == 0:
                continue
            drafts, q = self.pending[int(sid)]
            assert d <= len(drafts), f"request {sid}: {d} drafts scheduled, {len(drafts)} proposed"
            if q is None:
                parts.append(torch.zeros(d, self.vocab, dtype=torch.float32, device=self.device))
            else:
                parts.append(q[:d])
                any_random = True
        return torch.cat(parts) if any_random else None

    # ---- internals ------------------------------------------------------------------------------
    def _generator(self, sid: int, params: Any) -> torch.Generator:
        gen = self.generators.get(sid)
        if gen is None:
            # Separate from the target's generator; deterministic in the request (or its seed).
            seed = derive_seed(self.seed, f"draft:{sid}") if params.seed is None else derive_seed(params.seed, "draft")
            gen = torch.Generator(device="cpu")
            gen.manual_seed(seed)
            self.generators[sid] = gen
        return gen

    def _forward(self, rows: list[tuple[np.ndarray, int, Sequence[int]]]) -> torch.Tensor:
        """rows: (block_table, first position, input tokens). Logits [R, V] at each row's last token."""
        B = self.block_size
        lens = np.array([len(toks) for _, _, toks in rows], dtype=np.int64)
        starts = np.array([s for _, s, _ in rows], dtype=np.int64)
        ctx = starts + lens
        qsl = np.zeros(len(rows) + 1, dtype=np.int32)
        qsl[1:] = np.cumsum(lens)
        input_ids = np.concatenate([np.asarray(toks, dtype=np.int64) for _, _, toks in rows])
        positions = np.concatenate([np.arange(s, s + n, dtype=np.int64) for s, n in zip(starts, lens)])
        used = -(-ctx // B)
        max_blocks = int(used.max())
        tables = np.full((len(rows), max_blocks), -1, dtype=np.int32)
        slot_parts = []
        for i, ((table, start, _), u) in enumerate(zip(rows, used)):
            t = np.asarray(table[:u], dtype=np.int64)
            tables[i, :u] = t
            p = positions[qsl[i]:qsl[i + 1]]
            slot_parts.append(t[p // B] * B + p % B)
        batch = SimpleNamespace(
            input_ids=input_ids, positions=positions, slot_mapping=np.concatenate(slot_parts),
            block_tables=tables, query_start_loc=qsl, context_lens=ctx.astype(np.int32),
            max_query_len=int(lens.max()), max_context_len=int(ctx.max()),
            logits_indices=(qsl[1:] - 1).astype(np.int64))
        self.num_forwards += 1
        return self._fit_vocab(self.runner.execute(batch))

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

    def _sample(self, rows: list[_Row], logits: torch.Tensor) -> None:
        """Appends one draft (and, for random rows, its q row) to every row."""
        tokens = logits.argmax(dim=-1)
        random_idx = [i for i, r in enumerate(rows) if not r.params.is_greedy]
        if random_idx:
            idx = torch.tensor(random_idx, dtype=torch.long, device=logits.device)
            sub = [rows[i] for i in random_idx]
            tensors = SamplingTensors.from_params([r.params for r in sub], self.vocab, logits.device)
            q = compute_probs(logits.index_select(0, idx), tensors)
            u = draw_uniforms([self._generator(r.seq_id, r.params) for r in sub], [1] * len(sub), logits.device)
            tokens[idx] = sample_from_probs(q, u)
            for j, r in enumerate(sub):
                r.q.append(q[j])
        for r, t in zip(rows, tokens.tolist()):
            r.drafts.append(int(t))
