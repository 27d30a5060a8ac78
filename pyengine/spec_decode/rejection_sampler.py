"""Speculative verification (Leviathan et al. 2023; Chen et al. 2023) for ragged batches.

Row r proposes d_r >= 0 draft tokens and owns 1 + d_r consecutive target positions: position j
is the target distribution p_j for the token after the j-th input, so p_j judges draft j and
p_{d_r} yields the bonus token. Rows with d_r = 0 (plain decode rows, last prefill chunks)
simply sample one token from the processed p (inverse CDF, one uniform).

Random rows accept draft x_j with probability min(1, p_j(x_j) / q_j(x_j)); at the first
rejection they sample from normalize(max(p_j - q_j, 0)); when all drafts pass, they sample the
bonus from p_{d}. The emitted tokens are then distributed exactly as sampling from p one token
at a time. Greedy rows accept while the draft equals argmax p_j.

Layout: all bookkeeping works on [N, K] / [N, K + 1] padded views (K = max d_r) built with
index arithmetic, so the only per-row Python loop is drawing each row's uniforms from its own
generator. Row r draws exactly d_r + 1 uniforms per step: u_0..u_{d-1} decide acceptance and
u_d samples the correction / bonus token.

Non-finite logits (NaN, +-inf) are reported, not repaired: per row, the first emitted token whose
target position had them (RejectionOutput.first_nonfinite). Positions after the first rejected
draft emit nothing and do not count; the tokens from the reported one on are garbage.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from pyengine.engine.sampler import (SamplingTensors, compute_probs, draw_uniforms, finite_rows, first_nonfinite,
                                     sample_from_probs)
from pyengine.sampling_params import SamplingParams


@dataclass
class RejectionOutput:
    flat_tokens: torch.Tensor  # [sum(num_tokens)] int64, per row: accepted drafts, then the correction or bonus token
    num_tokens: torch.Tensor  # [N] int64, = num_accepted + 1
    num_accepted: torch.Tensor  # [N] int64, accepted drafts per row (for acceptance stats)
    # [N] int64 (CPU): per row, the first emitted token whose logits had a NaN or an inf, or -1. Only
    # the logits that gave emitted tokens count (a verify row's positions up to its first rejected
    # draft); the tokens from that one on are garbage. None: not checked.
    first_nonfinite: Optional[torch.Tensor] = None


def _leading_true(mask: torch.Tensor) -> torch.Tensor:
    """Per row, how many leading entries are True (the accepted prefix length)."""
    if mask.shape[1] == 0:
        return torch.zeros(mask.shape[0], dtype=torch.long, device=mask.device)
    return torch.cumprod(mask.to(torch.long), dim=1).sum(dim=1)


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """Row argmax (the first maximum, like torch). NumPy's is several times faster than
    torch's on CPU float32 rows of a vocabulary (about 5x at [160, 49152] on one thread)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2:
        return torch.from_numpy(logits.detach().numpy().argmax(axis=-1))
    return logits.argmax(dim=-1)


class RejectionSampler:
    def __call__(
        self,
        target_logits: torch.Tensor,
        draft_token_ids: torch.Tensor,
        num_draft_tokens: Sequence[int] | torch.Tensor,
        draft_probs: Optional[torch.Tensor],
        params: Sequence[SamplingParams],
        generators: Sequence[Optional[torch.Generator]],
    ) -> RejectionOutput:
        """target_logits [sum(1 + d_r), V]; draft_token_ids [sum d_r]; draft_probs None
        (deterministic drafter, q one-hot) or [sum d_r, V] (the processed distribution each
        draft was sampled from); one SamplingParams and generator per row (greedy rows may
        pass None)."""
        n_rows = len(params)
        greedy = [p.is_greedy for p in params]
        if all(greedy) and draft_token_ids.numel() == 0 and target_logits.shape[0] == n_rows \
                and not bool(torch.as_tensor(num_draft_tokens).any()):
            # Plain greedy decoding (no drafts in the batch): each row's token is its argmax. The
            # general path below gives the same, through a dozen small ops per step.
            argmax = greedy_argmax(target_logits)
            finite = finite_rows(target_logits, argmax).cpu()
            ones = torch.ones(n_rows, dtype=torch.long)
            return RejectionOutput(argmax.cpu(), ones, torch.zeros_like(ones), torch.where(finite, -1, 0))
        # Greedy rows need only the argmax: one reduction where the logits live, one copy, and the
        # small bookkeeping below on the CPU (on a GPU, dozens of tiny kernels and syncs otherwise).
        device = torch.device("cpu") if all(greedy) else target_logits.device
        argmax = greedy_argmax(target_logits) if any(greedy) else None
        # NaN / inf per target position, checked where the logits are (the argmax is the maximum)
        finite = finite_rows(target_logits, argmax).to(device)
        target_argmax = argmax.to(device) if argmax is not None else None
        vocab = target_logits.shape[-1]
        d = torch.as_tensor(num_draft_tokens, dtype=torch.long).reshape(-1).to(device)
        drafts_flat = draft_token_ids.reshape(-1).to(device=device, dtype=torch.long)
        total_drafts = int(d.sum()) if n_rows else 0
        if d.shape[0] != n_rows or len(generators) != n_rows:
            raise ValueError("num_draft_tokens, params and generators need one entry per row")
        if bool((d < 0).any()):
            raise ValueError("num_draft_tokens must be >= 0")
        if drafts_flat.shape[0] != total_drafts or target_logits.shape[0] != n_rows + total_drafts:
            raise ValueError("target_logits must have sum(1 + d_r) rows and draft_token_ids sum(d_r)")
        if draft_probs is not None and tuple(draft_probs.shape) != (total_drafts, vocab):
            raise ValueError("draft_probs must be [sum(d_r), V]")

        k = int(d.max()) if n_rows else 0
        pos_start = torch.cumsum(1 + d, 0) - (1 + d)  # first target position of each row
        draft_start = torch.cumsum(d, 0) - d
        cols = torch.arange(k, device=device)
        draft_valid = cols.unsqueeze(0) < d.unsqueeze(1)  # [N, K]
        draft_idx = torch.where(draft_valid, draft_start.unsqueeze(1) + cols, 0)
        drafts = torch.where(draft_valid, drafts_flat[draft_idx], -1) if k else draft_idx

        num_accepted = torch.zeros(n_rows, dtype=torch.long, device=device)
        final = torch.zeros(n_rows, dtype=torch.long, device=device)
        greedy_rows = [i for i, g in enumerate(greedy) if g]
        random_rows = [i for i, g in enumerate(greedy) if not g]

        if greedy_rows:
            gi = torch.tensor(greedy_rows, dtype=torch.long, device=device)
            # Rows padded to K + 1 positions; padding repeats the row's last valid position.
            pcols = torch.arange(k + 1, device=device)
            pos = pos_start[gi].unsqueeze(1) + torch.minimum(pcols.unsqueeze(0), d[gi].unsqueeze(1))
            row_argmax = target_argmax[pos]  # [G, K + 1]
            match = (drafts[gi] == row_argmax[:, :k]) & draft_valid[gi]
            acc = _leading_true(match)
            num_accepted[gi] = acc
            final[gi] = row_argmax.gather(1, acc.unsqueeze(1)).squeeze(1)

        if random_rows:
            acc, tok = self._verify_random(
                target_logits, drafts, draft_idx, draft_valid, draft_probs, d, pos_start,
                random_rows, params, generators,
            )
            ri = torch.tensor(random_rows, dtype=torch.long, device=device)
            num_accepted[ri] = acc
            final[ri] = tok

        # Emitted tokens: accepted drafts (columns < a) then the final token (column a).
        padded = torch.cat([drafts.clamp(min=0), torch.zeros_like(final).unsqueeze(1)], dim=1)
        padded.scatter_(1, num_accepted.unsqueeze(1), final.unsqueeze(1))
        keep = torch.arange(k + 1, device=device).unsqueeze(0) <= num_accepted.unsqueeze(1)
        flat = padded[keep]
        num_tokens = num_accepted + 1
        bad = first_nonfinite(finite, 1 + d, num_tokens).cpu()
        return RejectionOutput(flat, num_tokens, num_accepted, bad)

    @staticmethod
    def _verify_random(
        target_logits: torch.Tensor,
        drafts: torch.Tensor,
        draft_idx: torch.Tensor,
        draft_valid: torch.Tensor,
        draft_probs: Optional[torch.Tensor],
        d: torch.Tensor,
        pos_start: torch.Tensor,
        rows: list[int],
        params: Sequence[SamplingParams],
        generators: Sequence[Optional[torch.Generator]],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(accepted count, final token) for the non-greedy rows, in `rows` order."""
        device = target_logits.device
        vocab = target_logits.shape[-1]
        ri = torch.tensor(rows, dtype=torch.long, device=device)
        d_r = d[ri]
        counts = 1 + d_r
        k = drafts.shape[1]
        # Target positions of these rows, concatenated; local_start indexes into that list.
        local_start = torch.cumsum(counts, 0) - counts
        owner = torch.repeat_interleave(torch.arange(len(rows), device=device), counts)
        within = torch.arange(int(counts.sum()), device=device) - local_start[owner]
        positions = pos_start[ri][owner] + within
        counts_list = counts.tolist()
        tensors = SamplingTensors.from_params([params[i] for i in rows], vocab, device, counts_list)
        # p must be processed exactly as the plain sampler processes it: that is the
        # distribution the output has to follow.
        probs = compute_probs(target_logits[positions], tensors)  # [Tr, V]
        u = draw_uniforms([generators[i] for i in rows], counts_list, device)  # same layout

        drafts_r, valid_r, draft_idx_r = drafts[ri], draft_valid[ri], draft_idx[ri]
        cols = torch.arange(k, device=device)
        local_pos = torch.where(valid_r, local_start.unsqueeze(1) + cols, 0)  # [R, K]
        safe_drafts = drafts_r.clamp(min=0)
        p_draft = probs[local_pos, safe_drafts].double()
        if draft_probs is None:
            q_draft = torch.ones_like(p_draft)
        else:
            q_draft = draft_probs[draft_idx_r, safe_drafts].double()
        # u < p/q  <=>  u * q < p for q > 0: accepts with probability min(1, p/q), and never
        # accepts p == 0. q == 0 means the drafter could not have proposed it: reject.
        accept = valid_r & (q_draft > 0) & (u[local_pos] * q_draft < p_draft)
        acc = _leading_true(accept)

        p_at = probs[local_start + acc]  # [R, V]: p at the first rejected (or bonus) position
        rejected = acc < d_r
        dist = p_at
        if bool(rejected.any()):
            # Column of the first rejected draft; rows that accepted everything are masked
            # out by `rejected` below, so clamping their column is harmless.
            col = acc.clamp(max=k - 1).unsqueeze(1)
            if draft_probs is None:
                rejected_tok = safe_drafts.gather(1, col).squeeze(1)
                q_at = torch.nn.functional.one_hot(rejected_tok, vocab).to(p_at.dtype)
            else:
                q_at = draft_probs[draft_idx_r.gather(1, col).squeeze(1)].to(p_at.dtype)
            residual = (p_at - q_at).clamp(min=0)
            # An all-zero residual only arises from round-off when q ~= p; p is then the answer.
            empty = residual.sum(dim=-1) <= 0
            residual = torch.where(empty.unsqueeze(1), p_at, residual)
            dist = torch.where(rejected.unsqueeze(1), residual, p_at)
        tokens = sample_from_probs(dist, u[local_start + d_r])
        return acc, tokens
