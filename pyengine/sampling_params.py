"""Per-request sampling settings: a vLLM-compatible subset of `vllm.SamplingParams`.

Validation happens once, at construction, so the sampler's hot path can trust every field.
Each invalid value raises a ValueError whose one-line message starts with the field's name,
so a user sees at once which argument to fix.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

# Temperatures below this are treated as greedy (same threshold as vLLM): dividing logits by
# a near-zero temperature only approximates argmax, and does it with worse numerics.
GREEDY_TEMPERATURE_EPS = 1e-5
SEED_MIN, SEED_END = -(2**63), 2**64  # seeds are 64-bit (torch.Generator.manual_seed's range)
MAX_TOKEN_ID = 2**31 - 1  # token ids are int32 in the scheduler
MAX_LOGPROBS = 20  # most alternatives per output token (OpenAI's top_logprobs limit)


def _is_int(value: Any) -> bool:
    # bool is an int subclass; True as a seed or token id is almost certainly a bug.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 disables top-k
    min_p: float = 0.0
    seed: int | None = None  # None: derived from the engine seed and the request id
    max_tokens: int = 16
    stop: str | list[str] | None = None  # normalised to list[str]
    stop_token_ids: list[int] | None = None  # normalised to list[int]
    ignore_eos: bool = False
    # None: no logprobs; n >= 0: each output token's log-probability under the model (log_softmax
    # of its raw logits, before temperature and filters) and the n most likely alternatives
    logprobs: int | None = None

    def __post_init__(self) -> None:
        self._validate_numbers()
        self.stop = self._normalise_stop(self.stop)
        self.stop_token_ids = self._normalise_stop_token_ids(self.stop_token_ids)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")

    def _validate_numbers(self) -> None:
        t = self.temperature
        if not _is_real(t) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {t!r}")
        self.temperature = float(t)

        p = self.top_p
        if not _is_real(p) or not (0.0 < p <= 1.0):  # NaN fails the comparison too
            raise ValueError(f"top_p must be in (0, 1], got {p!r}")
        self.top_p = float(p)

        k = self.top_k
        if not _is_int(k) or k == 0 or k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or a positive int, got {k!r}")

        m = self.min_p
        if not _is_real(m) or not (0.0 <= m <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {m!r}")
        self.min_p = float(m)

        if self.seed is not None and (not _is_int(self.seed) or not SEED_MIN <= self.seed < SEED_END):
            raise ValueError(f"seed must be None or an int in [-2**63, 2**64) (a 64-bit seed), got {self.seed!r}")

        n = self.max_tokens
        if not _is_int(n) or not 1 <= n < 2**63:
            raise ValueError(f"max_tokens must be an int in 1..2**63-1, got {n!r}")

        lp = self.logprobs
        if lp is not None and (not _is_int(lp) or not 0 <= lp <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be None or an int in 0..{MAX_LOGPROBS}, got {lp!r}")

    @staticmethod
    def _normalise_stop(stop: Any) -> list[str]:
        if stop is None:
            return []
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
            raise ValueError(f"stop must be a str or a list of str, got {stop!r}")
        # An empty stop string would match at every position and end every request at once.
        if any(s == "" for s in stop):
            raise ValueError("stop must not contain empty strings")
        return list(stop)

    @staticmethod
    def _normalise_stop_token_ids(ids: Any) -> list[int]:
        if ids is None:
            return []
        if not isinstance(ids, (list, tuple)) or not all(_is_int(i) and 0 <= i <= MAX_TOKEN_ID for i in ids):
            raise ValueError(f"stop_token_ids must be a list of token ids (ints in 0..{MAX_TOKEN_ID}), got {ids!r}")
        return list(ids)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS

    @property
    def uses_filters(self) -> bool:
        """True when any of top-k / top-p / min-p changes the distribution."""
        return self.top_k != -1 or self.top_p < 1.0 or self.min_p > 0.0
