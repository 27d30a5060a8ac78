"""Sampling drafts from a proposer's logits, shared by the model-based proposers (draft model, MTP).

Greedy requests take the argmax of the draft logits; random requests sample from the PROCESSED
draft distribution q (the request's temperature/top-k/top-p/min-p) with a per-request draft
generator, and q is kept so the rejection sampler can accept with min(1, p/q) and resample from
norm(max(p - q, 0)): the target distribution is preserved whatever q is.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from pyengine.engine.sampler import SamplingTensors, compute_probs, derive_seed, draw_uniforms, sample_from_probs


@dataclass
class DraftRow:
    seq_id: int
    k: int  # drafts wanted
    params: Any  # the request's SamplingParams
    drafts: list[int] = field(default_factory=list)
    q: list[torch.Tensor] = field(default_factory=list)


class DraftSampler:
    def __init__(self, seed: int, vocab: int, device: torch.device) -> None:
        self.seed, self.vocab, self.device = int(seed), vocab, device
        self.generators: dict[int, torch.Generator] = {}
        self.pending: dict[int, tuple[list[int], Optional[torch.Tensor]]] = {}  # this step's drafts and q

    def sample(self, rows: Sequence[DraftRow], logits: torch.Tensor) -> None:
        """Appends one draft (and, for random rows, its q row) to every row; logits [len(rows), vocab]."""
        for r, t in zip(rows, self.draw(rows, logits).tolist()):
            r.drafts.append(int(t))

    def draw(self, rows: Sequence[DraftRow], logits: torch.Tensor) -> torch.Tensor:
        """One draft per row as a device tensor [len(rows)] int64 (no host sync: a chained proposer
        feeds it to its next forward and reads all drafts at the end); random rows' q rows appended."""
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
        return tokens

    def keep(self, rows: Sequence[DraftRow]) -> None:
        """Remember this step's drafts and q rows for draft_probs."""
        for r in rows:
            self.pending[r.seq_id] = (r.drafts, torch.stack(r.q) if r.q else None)

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

    def forget(self, seq_ids: Sequence[int], finished: bool) -> None:
        """A finished request's draft generator goes (a preempted one keeps it: same stream on return)."""
        if finished:
            for sid in seq_ids:
                self.generators.pop(int(sid), None)

    def _generator(self, sid: int, params: Any) -> torch.Generator:
        gen = self.generators.get(sid)
        if gen is None:
            # Separate from the target's generator; deterministic in the request (or its seed).
            seed = derive_seed(self.seed, f"draft:{sid}") if params.seed is None else derive_seed(params.seed, "draft")
            gen = torch.Generator(device="cpu")
            gen.manual_seed(seed)
            self.generators[sid] = gen
        return gen
