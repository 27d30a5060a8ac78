"""Speculative-decoding configuration (vLLM's names) and the proposers behind one interface.

A proposer runs before schedule() and gives each running decode request 0..k draft tokens through
the scheduler; verification (pyengine.rejection_sampler) decides what is kept.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

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

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SpeculativeConfig":
        if not isinstance(d, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(d).__name__}")
        known = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model", "script"}
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
        cfg = cls(method=method, num_speculative_tokens=k, model=d.get("model"), script=d.get("script"))
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


class AdaptiveDraftLength:
    """Proposes fewer drafts while recent acceptance is poor, so speculation never costs much more
    than it saves: the draft length follows an exponential average of accepted drafts per step,
    and drops to 0 (with a periodic probe) when almost nothing is accepted."""

    def __init__(self, k: int, probe_every: int = 8) -> None:
        self.k, self.probe_every = k, probe_every
        self.avg_accepted = float(k)  # optimistic start
        self.steps = 0

    def num_drafts(self) -> int:
        self.steps += 1
        if self.avg_accepted < 0.3:
            return self.k if self.steps % self.probe_every == 0 else 0
        return max(1, min(self.k, int(self.avg_accepted + 1.5)))

    def observe(self, drafted: int, accepted: int, rows: int) -> None:
        if rows == 0 or drafted == 0:
            return
        self.avg_accepted = 0.7 * self.avg_accepted + 0.3 * (accepted / rows)
