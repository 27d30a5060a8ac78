"""The OpenAI shapes of per-token logprobs (CompletionOutput.logprobs: per output token a dict
token id -> Logprob of the sampled token and the top alternatives, pyengine.outputs).

    completions: {"tokens", "token_logprobs", "top_logprobs": [{text: logprob}], "text_offset"}
    chat:        {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}
"""
from __future__ import annotations

from typing import Any

from pyengine.outputs import Logprob

TokenLogprobs = list[tuple[int, dict[int, Logprob]]]  # (sampled token id, its entry) per output token


def _top(entry: dict[int, Logprob], num_top: int) -> list[Logprob]:
    return sorted((lp for lp in entry.values() if lp.rank <= num_top), key=lambda lp: lp.rank)[:num_top]


def completion_logprobs(tokens: TokenLogprobs, num_top: int, text_offset: int = 0) -> dict[str, Any]:
    """text_offset: where the first token's text starts in the choice's text (streamed chunks
    continue the count)."""
    out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, entry in tokens:
        chosen = entry[token_id]
        text = chosen.decoded_token or ""
        out["tokens"].append(text)
        out["token_logprobs"].append(chosen.logprob)
        out["top_logprobs"].append({(lp.decoded_token or ""): lp.logprob for lp in _top(entry, num_top)})
        out["text_offset"].append(text_offset)
        text_offset += len(text)
    return out


def _chat_token(lp: Logprob) -> dict[str, Any]:
    text = lp.decoded_token or ""
    return {"token": text, "logprob": lp.logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(tokens: TokenLogprobs, num_top: int) -> dict[str, Any]:
    return {"content": [{**_chat_token(entry[token_id]), "top_logprobs": [_chat_token(lp) for lp in _top(entry, num_top)]}
                        for token_id, entry in tokens]}
