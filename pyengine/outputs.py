"""Request results, shaped like vLLM's so that users can switch."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """One token's log-probability under the model (log_softmax of the raw logits), its rank (1:
    the most likely) and its text."""
    logprob: float
    rank: int
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length", "abort", "error" or None while running
    # SamplingParams.logprobs set: per output token, {token id: Logprob} of the sampled token and
    # the top alternatives (None otherwise)
    logprobs: list[dict[int, Logprob]] | None = None


@dataclass
class RequestOutput:
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    error: str | None = None  # set when the request failed alone (finish_reason "error")
    metrics: dict[str, float] = field(default_factory=dict)
