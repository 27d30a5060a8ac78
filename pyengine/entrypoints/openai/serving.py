"""POST /v1/completions and /v1/chat/completions on an AsyncLLM.

A request becomes n engine requests per prompt (choice index = prompt index * n + i; a seeded
request's choices get seed, seed + 1, ...). All are admitted before the response starts, so
input the engine refuses (token ids out of the vocabulary, a prompt too long) is a 400, never a
broken stream. Streamed responses are server-sent events: one `data: {chunk}` per engine step
that produced text, the finish reasons, an optional usage chunk (stream_options.include_usage),
then `data: [DONE]`. A client that goes away aborts every engine request of its response.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse

from pyengine.engine.async_llm import AsyncLLM, RequestStream
from pyengine.entrypoints.openai.logprobs import TokenLogprobs, chat_logprobs, completion_logprobs
from pyengine.entrypoints.openai.metrics import ServerMetrics
from pyengine.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, RequestError, usage


class SSEResponse(StreamingResponse):
    """A StreamingResponse that always closes its generator (which aborts the engine requests),
    whether the stream ended, failed or the client went away."""

    def __init__(self, content: AsyncIterator[str]) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


@dataclass
class _Choice:
    index: int
    stream: RequestStream
    num_prompt_tokens: int
    prompt_index: int
    text: str = ""
    num_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None  # why the engine ended this choice, if it failed while running
    num_logprobs: int | None = None  # alternatives per token, when the request asked for logprobs
    logprobs: TokenLogprobs = field(default_factory=list)  # not yet sent (streamed) / all (not streamed)
    text_offset: int = 0  # completions' text_offset of the next streamed token

    def take(self, out: Any) -> None:
        """Account one RequestOutput delta."""
        delta = out.outputs[0]
        self.num_tokens += len(delta.token_ids)
        self.finish_reason = _finish_reason(out)
        self.error = out.error or self.error
        if delta.logprobs is not None:
            self.logprobs.extend(zip(delta.token_ids, delta.logprobs))

    def logprobs_body(self, chat: bool) -> dict[str, Any] | None:
        """The logprobs field for the tokens not yet sent (then cleared)."""
        if self.num_logprobs is None:
            return None
        tokens, self.logprobs = self.logprobs, []
        if chat:
            return chat_logprobs(tokens, self.num_logprobs)
        body = completion_logprobs(tokens, self.num_logprobs, self.text_offset)
        self.text_offset += sum(len(t) for t in body["tokens"])
        return body


class OpenAIServing:
    def __init__(self, engine: AsyncLLM, model_name: str, metrics: ServerMetrics) -> None:
        self.engine, self.model_name, self.metrics = engine, model_name, metrics
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.engine.cfg.max_model_len

    def check_model(self, name: str | None) -> None:
        """An absent model name means the served one; any other name is a 404, as OpenAI does."""
        if name is not None and name != self.model_name:
            raise RequestError(f"The model `{name}` does not exist (this server serves `{self.model_name}`).",
                               "model", status=404, code="model_not_found")

    # ---- endpoints ---------------------------------------------------------------------------------
    async def completions(self, body: CompletionRequest, http: HTTPRequest) -> Response:
        self.check_model(body.model)
        body.check()
        encoded = []
        for p in body.prompts():
            if isinstance(p, str):
                encoded.append((p, self.tokenizer.encode(p)))
            else:
                encoded.append((None, list(p)))
        choices = await self._admit(body, encoded, body.max_tokens)
        meta = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": self.model_name}
        if body.stream:
            return SSEResponse(self._stream(meta, choices, body.include_usage, chat=False))
        await self._collect(choices, http)
        return JSONResponse({**meta, "choices": [
            {"index": c.index, "text": c.text, "logprobs": c.logprobs_body(chat=False),
             "finish_reason": c.finish_reason} for c in choices], "usage": self._usage(choices)})

    async def chat(self, body: ChatCompletionRequest, http: HTTPRequest) -> Response:
        self.check_model(body.model)
        body.check()
        if not self.tokenizer.has_chat_template:
            raise RequestError("this model has no chat template; use /v1/completions", "messages")
        try:
            text = self.tokenizer.apply_chat_template([m.as_dict() for m in body.messages], add_generation_prompt=True)
        except Exception as e:  # the template's own checks (raise_exception) and jinja errors
            raise RequestError(f"messages: {str(e).splitlines()[0] if str(e) else type(e).__name__}",
                               "messages") from None
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        choices = await self._admit(body, [(text, ids)], body.requested_max_tokens())
        meta = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": self.model_name}
        if body.stream:
            return SSEResponse(self._stream({**meta, "object": "chat.completion.chunk"}, choices, body.include_usage,
                                            chat=True))
        await self._collect(choices, http)
        return JSONResponse({**meta, "choices": [
            {"index": c.index, "message": {"role": "assistant", "content": c.text},
             "logprobs": c.logprobs_body(chat=True), "finish_reason": c.finish_reason} for c in choices],
            "usage": self._usage(choices)})

    # ---- shared -------------------------------------------------------------------------------------
    async def _admit(self, body: Any, encoded: list[tuple[str | None, list[int]]],
                     max_tokens: int | None) -> list[_Choice]:
        """Admit n engine requests per prompt; on a refusal abort those admitted and raise a 400."""
        choices: list[_Choice] = []
        try:
            for p, (text, ids) in enumerate(encoded):
                limit = max_tokens if max_tokens is not None else self.max_model_len - len(ids)
                if max_tokens is None and limit < 1:
                    raise RequestError(f"the prompt ({len(ids)} tokens) leaves no room to generate within "
                                       f"max_model_len {self.max_model_len}", "messages")
                for i in range(body.n):
                    params = body.sampling_params(limit, i)
                    try:
                        stream = await self.engine.add_encoded(text, ids, params)
                    except ValueError as e:
                        raise RequestError(str(e).splitlines()[0], "prompt") from None
                    choices.append(_Choice(p * body.n + i, stream, len(ids), p, num_logprobs=params.logprobs))
        except BaseException:
            for c in choices:
                c.stream.abort()
            raise
        return choices

    async def _collect(self, choices: list[_Choice], http: HTTPRequest) -> None:
        """Run every choice to its end (non-streamed); a client that goes away aborts them."""
        async def run(c: _Choice) -> None:
            async for out in c.stream:
                c.text += out.outputs[0].text
                c.take(out)

        tasks = [asyncio.ensure_future(run(c)) for c in choices]
        try:
            while not all(t.done() for t in tasks):
                await asyncio.wait(tasks, timeout=0.5)
                if not all(t.done() for t in tasks) and await http.is_disconnected():
                    break
            for t in tasks:
                if t.done():
                    t.result()
        finally:
            for t in tasks:
                t.cancel()
            for c in choices:
                c.stream.abort()
        failed = next((c for c in choices if c.error), None)
        if failed is not None:  # a generation the engine could not finish: the server's failure, not the client's
            raise RequestError(f"generation failed: {failed.error}", None, status=500, type_="server_error")

    async def _stream(self, meta: dict[str, Any], choices: list[_Choice], include_usage: bool,
                      chat: bool) -> AsyncIterator[str]:
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(c: _Choice) -> None:
            try:
                async for out in c.stream:
                    await queue.put((c, out))
            except Exception as e:  # the engine failed this request
                await queue.put((c, e))
            await queue.put((c, None))

        tasks = [asyncio.ensure_future(pump(c)) for c in choices]
        try:
            if chat:  # the first chunk of each choice carries the role
                for c in choices:
                    yield _sse({**meta, "choices": [{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                                     "logprobs": None, "finish_reason": None}]})
            open_choices = len(choices)
            while open_choices:
                c, out = await queue.get()
                if out is None:
                    open_choices -= 1
                    continue
                if isinstance(out, Exception):
                    yield _sse({"error": {"message": str(out), "type": "server_error", "param": None, "code": None}})
                    continue
                delta = out.outputs[0]
                c.take(out)
                if not delta.text and c.finish_reason is None:
                    continue  # text held back (a stop string may start here): its logprobs wait too
                c.text += delta.text
                if chat:
                    choice = {"index": c.index, "delta": {"content": delta.text} if delta.text else {},
                              "logprobs": c.logprobs_body(chat=True), "finish_reason": c.finish_reason}
                else:
                    choice = {"index": c.index, "text": delta.text, "logprobs": c.logprobs_body(chat=False),
                              "finish_reason": c.finish_reason}
                yield _sse({**meta, "choices": [choice]})
            if include_usage:
                yield _sse({**meta, "choices": [], "usage": self._usage(choices)})
            yield "data: [DONE]\n\n"
        finally:
            for t in tasks:
                t.cancel()
            for c in choices:
                c.stream.abort()

    @staticmethod
    def _usage(choices: list[_Choice]) -> dict[str, int]:
        """Each prompt's tokens once (whatever n), every choice's output tokens."""
        prompts = {c.prompt_index: c.num_prompt_tokens for c in choices}
        return usage(sum(prompts.values()), sum(c.num_tokens for c in choices))


def _finish_reason(out: Any) -> str | None:
    return out.outputs[0].finish_reason if out.finished else None


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
