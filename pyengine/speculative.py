"""Speculative-decoding configuration (vLLM's names) and the proposers behind one interface.

A proposer runs before schedule() and gives each running decode request 0..k draft tokens through
the scheduler; verification (pyengine.rejection_sampler) decides what is kept.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

import numpy as np

from pyengine import _C

# script(request_id, committed_token_ids) -> drafts: forces any acceptance pattern in tests.
DraftScript = Callable[[int, list[int]], list[int]]


@dataclass
class SpeculativeConfig:
    method: str  # "ngram", "draft_model" or "scripted"
    num_speculative_tokens: int
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    model: str | None = None
    script: DraftScript | None = None
    adaptive_draft_length: bool = True  # False: always propose up to k (tests pin every path)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SpeculativeConfig":
        if not isinstance(d, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(d).__name__}")
        known = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model", "script",
                 "adaptive_draft_length"}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {sorted(unknown)} (known: {sorted(known)})")
        method = d.get("method") or ("draft_model" if d.get("model") else None)
        if method == "draft":
            method = "draft_model"
        if method not in ("ngram", "draft_model", "scripted"):
            raise ValueError(f"speculative_config.method must be 'ngram', 'draft_model' or 'scripted', got {method!r}")
        k = d.get("num_speculative_tokens")
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 32:
            raise ValueError(f"speculative_config.num_speculative_tokens must be an int in 1..32, got {k!r}")
        adaptive = d.get("adaptive_draft_length", True)
        if not isinstance(adaptive, bool):
            raise ValueError(f"speculative_config.adaptive_draft_length must be a bool, got {adaptive!r}")
        cfg = cls(method=method, num_speculative_tokens=k, model=d.get("model"), script=d.get("script"),
                  adaptive_draft_length=adaptive)
        if method == "ngram":
            cfg.prompt_lookup_max = int(d.get("prompt_lookup_max", 4))
            cfg.prompt_lookup_min = int(d.get("prompt_lookup_min", min(2, cfg.prompt_lookup_max)))
            if not 1 <= cfg.prompt_lookup_min <= cfg.prompt_lookup_max:
                raise ValueError("speculative_config: need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                                 f"{cfg.prompt_lookup_min}..{cfg.prompt_lookup_max}")
        if method == "draft_model" and not cfg.model:
            raise ValueError("speculative_config.model (the draft model's path) is required for a draft model")
        if method == "scripted" and not callable(cfg.script):
            raise ValueError("speculative_config.script must be a callable for method 'scripted'")
        return cfg


class Proposer(Protocol):
    def propose(self, scheduler: _C.Scheduler, num_drafts: int) -> None: ...


class NgramProposer:
    """Prompt lookup over prompt + generated tokens, in C++ (pyengine/_C: propose_ngram)."""

    def __init__(self, cfg: SpeculativeConfig) -> None:
        self.min_n, self.max_n = cfg.prompt_lookup_min, cfg.prompt_lookup_max

    def propose(self, scheduler: _C.Scheduler, num_drafts: int) -> None:
        scheduler.propose_ngram(self.min_n, self.max_n, num_drafts)


class ScriptedProposer:
    """Proposes whatever the script returns (truncated to num_drafts): tests force acceptance patterns."""

    def __init__(self, cfg: SpeculativeConfig) -> None:
        assert cfg.script is not None
        self.script = cfg.script

    def propose(self, scheduler: _C.Scheduler, num_drafts: int) -> None:
        for seq_id in scheduler.running_ids():
            tokens = scheduler.token_ids(seq_id)
            if scheduler.num_computed(seq_id) != len(tokens) - 1:
                continue  # still prefilling: no drafts
            drafts = list(self.script(seq_id, tokens))[:num_drafts]
            scheduler.set_draft_tokens(seq_id, drafts)


class DraftLengthPolicy:
    """How many drafts to propose each step: the length with the best expected goodput.

        goodput(k) = (R + R_d * sum_{j<k} P_j) / T(R + R_d * k)

    R decode rows, R_d of them with drafts (the proposer may find none for a row); P_j the chance
    that drafts 0..j are all accepted (decayed counts from recent verify rows); T(n) = a + b n the
    step time for n tokens fed, a least-squares line through recent decode-only steps. Where
    speculation does not pay (poor acceptance, or a batch large enough that verify tokens cost
    real compute) the best length is 0, so speculation never costs much more than it saves; a
    probe at full length every `probe_every` steps keeps the acceptance estimate fresh.
    """

    def __init__(self, k: int, probe_every: int = 48, decay: float = 0.95, margin: float = 0.05) -> None:
        # margin: speculate only for an expected gain above it; the model omits the proposal and
        # verification overheads, so near break-even plain decoding is the safer choice
        self.k, self.probe_every, self.decay, self.margin = k, probe_every, decay, margin
        self.accepted = [1.0] * k  # decayed counts; start optimistic: P_j = 1
        self.drafted = [1.0] * k
        self.rows = self.rows_with_drafts = 1.0
        self.fit_sums = [0.0] * 5  # decayed sums of 1, n, t, n*n, n*t over decode-only steps
        self.steps = 0

    def num_drafts(self, num_rows: int) -> int:
        self.steps += 1
        rows = max(num_rows, 1)
        # Probes (and the warm-up that gives the time line two token counts) stay cheap where
        # verify tokens cost compute: about k extra tokens per step whatever the batch size.
        probe = max(1, min(self.k, round(self.k / rows)))
        if self.steps <= 4:
            return probe if self.steps % 2 else 0
        if self.steps % self.probe_every == 0:
            return probe
        line = self._time_line()
        if line is None:
            return probe
        a, b = line
        with_drafts = rows * self.rows_with_drafts / self.rows
        best_k, best, expected = 0, (1.0 + self.margin) * rows / (a + b * rows), 0.0
        for j in range(self.k):
            expected += self.accepted[j] / self.drafted[j]
            goodput = (rows + with_drafts * expected) / (a + b * (rows + with_drafts * (j + 1)))
            if goodput > best:
                best_k, best = j + 1, goodput
        return best_k

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """A decode-only step: n tokens fed took `seconds`."""
        for i, v in enumerate((1.0, num_tokens, seconds, num_tokens * num_tokens, num_tokens * seconds)):
            self.fit_sums[i] = self.decay * self.fit_sums[i] + v

    def observe_rows(self, num_drafts: np.ndarray, num_committed: np.ndarray) -> None:
        """The decode rows of a step that proposed drafts: drafts verified and tokens committed."""
        self.rows = self.decay * self.rows + len(num_drafts)
        self.rows_with_drafts = self.decay * self.rows_with_drafts + float((num_drafts > 0).sum())
        for j in range(self.k):
            had = num_drafts > j
            self.drafted[j] = self.decay * self.drafted[j] + float(had.sum())
            self.accepted[j] = self.decay * self.accepted[j] + float((had & (num_committed - 1 > j)).sum())

    def _time_line(self) -> tuple[float, float] | None:
        s1, sn, st, snn, snt = self.fit_sums
        var = s1 * snn - sn * sn
        if s1 < 2 or var <= 1e-9 * max(snn * s1, 1.0):
            return None
        b = max((s1 * snt - sn * st) / var, 0.0)
        a = max((st - b * sn) / s1, 1e-9)
        return a, b
