"""Sampling pieces: logits -> processed probabilities -> tokens (the rejection sampler draws
with them; its rows without drafts are plain sampling).

Rows may carry different SamplingParams. Filters are applied in a fixed order (temperature,
top-k, top-p, min-p) with per-row tensors, so a mixed batch costs one sort at most, and a batch
where no row uses a filter skips the sort entirely.

Randomness: every request owns a seeded torch.Generator, and a row draws only from its own
generator, so its token does not depend on which other requests share the batch. Sampling uses
the inverse CDF with ONE uniform per token: a row consumes a fixed, small amount of randomness
regardless of vocabulary size, and the rejection sampler can reuse the exact same routine
(a d=0 verify row is plain sampling).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Hashable, Optional, Sequence

import numpy as np
import torch

from pyengine.sampling_params import SamplingParams

_SEED_MASK = (1 << 63) - 1  # manual_seed accepts 64-bit values; 63 bits keep it positive


def derive_seed(engine_seed: int, request_id: Hashable) -> int:
    """A stable per-request seed. Python's hash() is salted per process, so use blake2b."""
    digest = hashlib.blake2b(f"{engine_seed}:{request_id!r}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & _SEED_MASK


class RequestGenerators:
    """Creates and keeps one torch.Generator per live request id.

    Generators live on `device` (CPU by default): drawing a handful of uniforms on the CPU and
    copying them once per step is cheaper than one tiny GPU kernel per row.
    """

    def __init__(self, engine_seed: int = 0, device: str | torch.device = "cpu") -> None:
        self.engine_seed = int(engine_seed)
        self.device = torch.device(device)
        self._gens: dict[Hashable, torch.Generator] = {}

    def get(self, request_id: Hashable, seed: Optional[int] = None) -> torch.Generator:
        """The request's generator, created on first use from `seed` (or a derived seed)."""
        gen = self._gens.get(request_id)
        if gen is None:
            s = derive_seed(self.engine_seed, request_id) if seed is None else seed
            gen = torch.Generator(device=self.device)
            gen.manual_seed(int(s) & 0xFFFF_FFFF_FFFF_FFFF)
            self._gens[request_id] = gen
        return gen

    def release(self, request_id: Hashable) -> None:
        self._gens.pop(request_id, None)

    def __contains__(self, request_id: Hashable) -> bool:
        return request_id in self._gens

    def __len__(self) -> int:
        return len(self._gens)


@dataclass
class SamplingTensors:
    """Per-row filter parameters as tensors; a field is None when no row uses it (fast path)."""

    temperature: Optional[torch.Tensor]  # [N] fp32; greedy rows hold 1.0 (their probs are unused)
    top_k: Optional[torch.Tensor]  # [N] int64; disabled rows hold V
    top_p: Optional[torch.Tensor]  # [N] fp32; disabled rows hold 1.0
    min_p: Optional[torch.Tensor]  # [N] fp32; disabled rows hold 0.0

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        vocab_size: int,
        device: str | torch.device = "cpu",
        repeats: Optional[Sequence[int]] = None,
    ) -> "SamplingTensors":
        """Row i of the result uses params[i], repeated repeats[i] times when given
        (the rejection sampler has 1 + d_r target positions per request)."""
        temps = [1.0 if p.is_greedy else p.temperature for p in params]
        ks = [vocab_size if p.top_k == -1 else min(p.top_k, vocab_size) for p in params]
        tps = [p.top_p for p in params]
        mps = [p.min_p for p in params]
        rep = None if repeats is None else torch.as_tensor(list(repeats), dtype=torch.long)

        def build(values: list, dtype: torch.dtype, neutral: float) -> Optional[torch.Tensor]:
            if all(v == neutral for v in values):
                return None
            t = torch.tensor(values, dtype=dtype)
            if rep is not None:
                t = torch.repeat_interleave(t, rep)
            return t.to(device)

        return cls(
            temperature=build(temps, torch.float32, 1.0),
            top_k=build(ks, torch.long, vocab_size),
            top_p=build(tps, torch.float32, 1.0),
            min_p=build(mps, torch.float32, 0.0),
        )


# Top-p first looks for the nucleus among each row's top _TOP_P_WINDOW logits (a partial
# top-k, O(V)); only rows whose nucleus does not fit get the full O(V log V) sort. LLM
# distributions are peaked, so the fallback is rare, and the result is exact either way.
_TOP_P_WINDOW = 1024


def _thresholds(
    logits: torch.Tensor, k: torch.Tensor, top_p: Optional[torch.Tensor], window: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the lowest logit that survives top-k then top-p, looking only at the top
    `window` logits; plus a flag saying whether the window was large enough."""
    vocab = logits.shape[-1]
    if window < vocab:  # [R, window], descending
        vals = torch.topk(logits, window, dim=-1, sorted=True).values
    else:  # a full sort is much faster than topk(k = V)
        vals = torch.sort(logits, dim=-1, descending=True).values
    neg_inf = torch.full_like(vals[:, 0], float("-inf"))
    has_k = k < vocab
    kth = vals.gather(1, (k.clamp(max=window) - 1).unsqueeze(1)).squeeze(1)
    # Threshold by value: tokens tied with the k-th are all kept (order-independent).
    thr_k = torch.where(has_k, kth, neg_inf)
    ok = torch.ones_like(has_k)
    if top_p is None:
        return thr_k, ok
    # Mass of the top-k survivors over the FULL row (ties beyond the window included),
    # so the nucleus is measured in the renormalised top-k distribution.
    full = torch.softmax(logits, dim=-1)
    kept_mass = (full * (logits >= thr_k.unsqueeze(1))).sum(dim=-1, keepdim=True)
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    p_win = torch.exp(vals - lse) * (vals >= thr_k.unsqueeze(1)) / kept_mass
    mass_before = torch.cumsum(p_win, dim=-1) - p_win
    # Keep token i iff the mass strictly before it is < top_p: the smallest prefix reaching
    # top_p (at least one token, since mass_before[0] = 0 < top_p).
    n_keep = (mass_before < top_p.unsqueeze(1)).sum(dim=-1).clamp(min=1)
    thr_p = vals.gather(1, (n_keep - 1).unsqueeze(1)).squeeze(1)
    # Rows with top_p == 1 are left alone so cumsum round-off can never drop their tail.
    active = top_p < 1.0
    thr_p = torch.where(active, thr_p, neg_inf)
    if window < vocab:  # every window token kept: the nucleus may extend past the window
        ok = ~active | (n_keep < window)
    return torch.maximum(thr_k, thr_p), ok


def _apply_top_k_top_p(
    logits: torch.Tensor, top_k: Optional[torch.Tensor], top_p: Optional[torch.Tensor]
) -> torch.Tensor:
    """Mask (to -inf) logits outside each row's top-k, then outside its nucleus."""
    rows, vocab = logits.shape
    k = torch.full((rows,), vocab, dtype=torch.long, device=logits.device)
    if top_k is not None:
        k = top_k.clamp(1, vocab)
    need = torch.where(k < vocab, k, 1)
    if top_p is not None:
        need = torch.where(top_p < 1.0, torch.maximum(need, k.clamp(max=_TOP_P_WINDOW)), need)
    window = min(vocab, int(need.max()))
    thr, ok = _thresholds(logits, k, top_p, window)
    if not bool(ok.all()):
        bad = (~ok).nonzero().squeeze(1)
        sub_p = None if top_p is None else top_p[bad]
        thr[bad] = _thresholds(logits[bad], k[bad], sub_p, vocab)[0]
    # Ties with the boundary token are kept, for top-p too: the kept set depends on values only.
    return logits.masked_fill(logits < thr.unsqueeze(1), float("-inf"))


def _apply_min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    probs = probs.masked_fill(probs < threshold, 0.0)  # the max token always survives
    return probs / probs.sum(dim=-1, keepdim=True)


def compute_probs(logits: torch.Tensor, tensors: SamplingTensors) -> torch.Tensor:
    """[N, V] logits -> [N, V] fp32 probabilities after temperature, top-k, top-p, min-p."""
    x = logits.float()
    if tensors.temperature is not None:
        x = x / tensors.temperature.unsqueeze(1)
    if tensors.top_k is not None or tensors.top_p is not None:
        x = _apply_top_k_top_p(x, tensors.top_k, tensors.top_p)
    probs = torch.softmax(x, dim=-1)
    if tensors.min_p is not None:
        probs = _apply_min_p(probs, tensors.min_p)
    return probs


def probs_from_params(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Convenience: compute_probs with one SamplingParams per row."""
    tensors = SamplingTensors.from_params(params, logits.shape[-1], logits.device)
    return compute_probs(logits, tensors)


def draw_uniforms(
    generators: Sequence[Optional[torch.Generator]],
    counts: Sequence[int],
    device: str | torch.device = "cpu",
) -> torch.Tensor:
    """counts[i] uniforms in [0, 1) from generators[i], concatenated; float64 so that
    u * mass comparisons are not limited by fp32 resolution."""
    chunks = []
    for gen, n in zip(generators, counts):
        if gen is None:
            raise ValueError("a non-greedy row needs a torch.Generator")
        chunks.append(torch.rand(int(n), generator=gen, dtype=torch.float64, device=gen.device))
    if not chunks:
        return torch.empty(0, dtype=torch.float64, device=device)
    return torch.cat([c.to(device) for c in chunks])


def finite_rows(logits: torch.Tensor, argmax: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[N, V] logits -> [N] bool, where the logits live: is the row free of NaN and +-inf? Its
    minimum and maximum are both finite (NaN propagates through both). argmax: the rows' argmax,
    if already computed (NaN or +inf is what it picks), saves the maximum: the check then costs
    one reduction. CPU float32 rows go through NumPy (torch.aminmax is far slower there)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2:
        x = logits.detach().numpy()
        if argmax is None:
            top = x.max(axis=-1)
        else:
            top = x[np.arange(x.shape[0]), argmax.numpy()]
        return torch.from_numpy(np.isfinite(top) & np.isfinite(x.min(axis=-1)))
    if argmax is None:
        low, top = torch.aminmax(logits, dim=-1)
    else:
        low, top = logits.amin(dim=-1), logits.gather(1, argmax.view(-1, 1)).view(-1)
    return torch.isfinite(low) & torch.isfinite(top)


def first_nonfinite(finite: torch.Tensor, num_logits: torch.Tensor, num_tokens: torch.Tensor) -> torch.Tensor:
    """Per row, the first of its tokens whose logits are not finite, or -1. finite: [sum(num_logits)]
    per logits row; row r owns num_logits[r] consecutive logits rows, and its num_tokens[r] tokens
    came from the first num_tokens[r] of them (a verify row: accepted drafts, then the correction
    or bonus token). Logits after a rejected draft gave no token and are not looked at."""
    rows = num_logits.shape[0]
    width = int(num_tokens.max()) if rows else 0
    starts = torch.cumsum(num_logits, 0) - num_logits
    cols = torch.arange(width, device=finite.device)
    used = cols.unsqueeze(0) < num_tokens.unsqueeze(1)  # [N, W]
    idx = torch.where(used, starts.unsqueeze(1) + cols, 0)
    bad = used & ~finite[idx]
    return torch.where(bad.any(dim=1), bad.to(torch.int8).argmax(dim=1), -1)


def sample_from_probs(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: row i picks the first token whose cumulative mass exceeds
    uniforms[i] * total mass. Rows need not be normalised (residuals are passed raw).
    Zero-mass tokens are never picked: their CDF step is empty."""
    cdf = probs.double().cumsum(dim=-1)
    target = (uniforms.to(cdf.device) * cdf[:, -1]).unsqueeze(1)
    tokens = torch.searchsorted(cdf, target, right=True).squeeze(1)
    # u * total can round up to total; then clamp to the last token that has mass.
    vocab = probs.shape[-1]
    last_nonzero = vocab - 1 - (probs > 0).flip(-1).to(torch.int8).argmax(dim=-1)
    return torch.minimum(tokens, last_nonzero)


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row of logits [n, vocab] (raw: no temperature or filter): the log-probability of
    token_ids[i] and its rank (1 + the tokens strictly more likely), and the num_top most likely
    tokens with theirs. All fp32 and per row, so a token's values never depend on the other rows."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, token_ids.view(-1, 1).long())
    rank = (lp > chosen).sum(dim=1) + 1
    top = lp.topk(num_top, dim=-1) if num_top > 0 else None
    empty = lp.new_empty(lp.shape[0], 0)
    return (chosen.view(-1), rank, top.indices if top is not None else empty.long(),
            top.values if top is not None else empty)
