"""The OpenAI API's request bodies (pydantic) and their translation to SamplingParams.

Each field the server does not implement is refused with a 400 naming it (echo, suffix, best_of,
logit_bias, non-zero penalties) rather than ignored.
Extensions (vLLM's names): top_k, min_p, stop_token_ids, ignore_eos.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pyengine.sampling_params import MAX_LOGPROBS, SamplingParams

MAX_N = 16  # choices per request


class RequestError(ValueError):
    """A bad request: HTTP status (400, 404), the offending parameter, the message."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type_: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type_, code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.param, self.type, self.code)


def error_body(message: str, param: str | None = None, type_: str = "invalid_request_error",
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    """The fields completions and chat share."""
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    def _refuse_unsupported(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if value not in (None, 0, 0.0):
                raise RequestError(f"{name} is not supported (only 0)", name)
        if self.logit_bias:
            raise RequestError("logit_bias is not supported", "logit_bias")
        if not 1 <= self.n <= MAX_N:
            raise RequestError(f"n must be an int in [1, {MAX_N}], got {self.n}", "n")

    def sampling_params(self, max_tokens: int, index: int = 0) -> SamplingParams:
        """SamplingParams for choice `index` (choices of a seeded request get seed, seed + 1, ...)."""
        kw: dict[str, Any] = {"max_tokens": max_tokens, "ignore_eos": self.ignore_eos}
        for name in ("temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids"):
            value = getattr(self, name)
            if value is not None:
                kw[name] = value
        if self.top_k == 0:  # OpenAI-style clients may send 0 for "off"
            kw["top_k"] = -1
        if self.seed is not None:
            kw["seed"] = self.seed + index
        if self.num_logprobs() is not None:
            kw["logprobs"] = self.num_logprobs()
        try:
            return SamplingParams(**kw)
        except ValueError as e:
            message = str(e)
            raise RequestError(message, message.split(" ", 1)[0]) from None

    def num_logprobs(self) -> int | None:
        """Alternatives per token for SamplingParams.logprobs (None: no logprobs)."""
        return None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def check(self) -> None:
        self._refuse_unsupported()
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise RequestError(f"logprobs must be an int in [0, {MAX_LOGPROBS}], got {self.logprobs}", "logprobs")
        if self.echo:
            raise RequestError("echo is not supported", "echo")
        if self.suffix:
            raise RequestError("suffix is not supported", "suffix")
        if self.best_of not in (None, 1):
            raise RequestError("best_of is not supported", "best_of")

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def prompts(self) -> list[str | list[int]]:
        """The prompts: a str, a list of token ids, or a list of either (one choice set each)."""
        p = self.prompt
        if isinstance(p, str) or (isinstance(p, list) and p and all(isinstance(t, int) for t in p)):
            p = [p]
        if not p:
            raise RequestError("prompt must not be empty", "prompt")
        for one in p:
            if not one:
                raise RequestError("prompt must not be empty", "prompt")
        return list(p)


class ContentPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart]
    name: str | None = None

    def as_dict(self) -> dict[str, str]:
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": content}


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None

    def check(self) -> None:
        self._refuse_unsupported()
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise RequestError("top_logprobs needs logprobs: true", "top_logprobs")
            if not 0 <= self.top_logprobs <= MAX_LOGPROBS:
                raise RequestError(f"top_logprobs must be an int in [0, {MAX_LOGPROBS}], got {self.top_logprobs}",
                                   "top_logprobs")
        if self.tools:
            raise RequestError("tools are not supported", "tools")

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
