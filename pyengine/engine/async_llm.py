"""`AsyncLLM`: streaming over asyncio, with one background thread that owns the engine.

The engine is not thread-safe, so only the loop thread touches it. Callers (coroutines on any
event loop) hand it commands through a queue (add a request, abort one, read the stats); it runs
them between steps, steps while any request is unfinished, and sends each request's new tokens
and text back to the caller's event loop (call_soon_threadsafe) as a RequestOutput delta.

    llm = AsyncLLM(LLM())  # starts the loop thread
    async for delta in llm.generate("The sea is", SamplingParams(max_tokens=32)):
        print(delta.outputs[0].text, end="")
    llm.shutdown()

A caller that stops iterating (a cancelled task, a closed generator: an HTTP client that went
away) aborts its request: the engine frees its blocks before the next step.
"""
from __future__ import annotations

import asyncio
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from pyengine.engine.llm import LLM
from pyengine.engine.output_processor import Request
from pyengine.outputs import CompletionOutput, RequestOutput
from pyengine.sampling_params import SamplingParams


@dataclass
class _Stream:
    """One request as the loop thread sees it: where its deltas go and what it has sent so far."""
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: float = field(default_factory=time.perf_counter)
    admitted: asyncio.Future | None = None
    req: Request | None = None
    sent_chars: int = 0
    sent_tokens: int = 0
    first_token_time: float | None = None
    done: bool = False

    def put(self, item: Any) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class RequestStream:
    """The deltas of one admitted request (AsyncLLM.add_request): iterate it; stop early (or call
    abort()) to abort the request."""

    def __init__(self, llm: "AsyncLLM", stream: _Stream) -> None:
        self._llm, self._stream = llm, stream
        self.request_id = stream.req.request_id
        self.prompt_token_ids = stream.prompt_token_ids

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        try:
            while True:
                item = await self._stream.queue.get()
                if isinstance(item, Exception):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            self.abort()

    def abort(self) -> None:
        if not self._stream.done:
            self._stream.done = True
            self._llm._submit(("abort", self._stream))


class AsyncLLM:
    """An LLM whose requests stream: add_request / generate from coroutines, while one thread
    steps the engine. stats() gives engine.stats() plus the KV cache's use and the queue sizes."""

    def __init__(self, llm: LLM) -> None:
        self.llm, self.engine, self.tokenizer = llm, llm.engine, llm.tokenizer
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = False
        self._streams: dict[int, _Stream] = {}  # engine request id -> stream, while unfinished
        self.on_finish = None  # optional callback(stream info dict), called on the loop thread
        self._thread = threading.Thread(target=self._run, name="pyengine-engine-loop", daemon=True)
        self._thread.start()

    # ---- caller side (any event loop) ------------------------------------------------------------
    async def add_request(self, prompt: str | list[int], params: SamplingParams) -> RequestStream:
        """Tokenize (a str prompt) and queue a request; returns once the engine admitted it.
        Raises ValueError when the engine refuses it (token ids out of the vocabulary, too long)."""
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, ids = None, list(prompt)
        return await self.add_encoded(text, ids, params)

    async def add_encoded(self, text: str | None, ids: list[int], params: SamplingParams) -> RequestStream:
        loop = asyncio.get_running_loop()
        stream = _Stream(loop, asyncio.Queue(), text, ids, params, admitted=loop.create_future())
        self._submit(("add", stream))
        try:
            await stream.admitted
        except asyncio.CancelledError:
            stream.done = True
            self._submit(("abort", stream))
            raise
        return RequestStream(self, stream)

    async def generate(self, prompt: str | list[int], params: SamplingParams | None = None) -> AsyncIterator[RequestOutput]:
        """The RequestOutput deltas of one request: each carries the text and token ids produced
        since the previous one; the last has finished=True and the finish reason."""
        stream = await self.add_request(prompt, params or SamplingParams())
        async for out in stream:
            yield out

    async def stats(self) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._submit(("stats", (loop, fut)))
        return await fut

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=30)

    def _submit(self, command: tuple) -> None:
        self._commands.put(command)
        self._wake.set()

    # ---- loop thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop:
            self._run_commands()
            if not self.engine.has_unfinished():
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                touched = self.engine.step()
            except Exception as e:  # an engine bug: fail the running requests, keep serving
                self._fail_all(RuntimeError(f"engine step failed: {type(e).__name__}: {e}"))
                continue
            now = time.perf_counter()
            for req in touched:
                stream = self._streams.get(req.request_id)
                if stream is not None:
                    self._send(stream, now)
        self._fail_all(RuntimeError("the engine was shut down"))

    def _run_commands(self) -> None:
        while True:
            try:
                kind, arg = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self._add(arg)
            elif kind == "abort":
                if arg.req is not None and self._streams.pop(arg.req.request_id, None) is not None:
                    self.engine.abort_request(arg.req.request_id)
                    self._finished(arg, time.perf_counter())
            elif kind == "stats":
                loop, fut = arg
                try:
                    result = self._stats()
                except Exception as e:  # reported to the caller
                    loop.call_soon_threadsafe(_set_exception, fut, e)
                else:
                    loop.call_soon_threadsafe(_set_result, fut, result)

    def _add(self, stream: _Stream) -> None:
        if stream.done:  # its caller went away before admission
            return
        try:
            req = self.engine.add_request(stream.prompt_token_ids, stream.params, prompt=stream.prompt, stream=True)
        except Exception as e:  # bad input the engine raises for
            stream.loop.call_soon_threadsafe(_set_exception, stream.admitted, ValueError(str(e)))
            return
        if req.error:
            stream.loop.call_soon_threadsafe(_set_exception, stream.admitted, ValueError(req.error))
            return
        stream.req = req
        self._streams[req.request_id] = stream
        stream.loop.call_soon_threadsafe(_set_result, stream.admitted, req.request_id)

    def _send(self, stream: _Stream, now: float) -> None:
        req = stream.req
        text = req.text
        visible = len(text)
        if not req.finished and req.params.stop:
            # a stop string may still cut the text back: hold back what could be its start
            visible = max(stream.sent_chars, len(text) - max(len(s) for s in req.params.stop) + 1)
        new_text = text[stream.sent_chars:visible]
        new_ids = req.output_token_ids[stream.sent_tokens:]
        if not new_text and not new_ids and not req.finished:
            return
        if new_ids and stream.first_token_time is None:
            stream.first_token_time = now
        stream.sent_chars, stream.sent_tokens = visible, len(req.output_token_ids)
        new_logprobs = None if req.logprobs is None else req.logprobs[stream.sent_tokens - len(new_ids):stream.sent_tokens]
        completion = CompletionOutput(0, new_text, new_ids, req.finish_reason, new_logprobs)
        out = RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, [completion], req.finished, req.error,
                            metrics=self._metrics(stream, now))
        stream.put(out)
        if req.finished:
            self._streams.pop(req.request_id, None)
            self._finished(stream, now)

    @staticmethod
    def _metrics(stream: _Stream, now: float) -> dict[str, float]:
        m = {"arrival_time": stream.arrival, "num_output_tokens": float(len(stream.req.output_token_ids))}
        if stream.first_token_time is not None:
            m["time_to_first_token"] = stream.first_token_time - stream.arrival
        m["elapsed"] = now - stream.arrival
        return m

    def _finished(self, stream: _Stream, now: float) -> None:
        stream.done = True
        if self.on_finish is not None:
            req = stream.req
            n = len(req.output_token_ids)
            info = {"finish_reason": req.finish_reason, "num_prompt_tokens": len(req.prompt_token_ids),
                    "num_output_tokens": n, "ttft": None, "tpot": None, "e2e": now - stream.arrival}
            if stream.first_token_time is not None:
                info["ttft"] = stream.first_token_time - stream.arrival
                if n > 1:
                    info["tpot"] = (now - stream.first_token_time) / (n - 1)
            try:
                self.on_finish(info)
            except Exception:  # a metrics hook must never stop the loop
                pass

    def _stats(self) -> dict[str, Any]:
        s = self.engine.stats()
        sched = self.engine.scheduler
        total = self.engine.cfg.num_kv_blocks
        s.update({"num_kv_blocks": total, "num_free_kv_blocks": int(sched.num_free_blocks),
                  "kv_cache_usage": 1.0 - sched.num_free_blocks / total if total else 0.0,
                  "num_running": int(sched.num_running), "num_waiting": int(sched.num_waiting)})
        return s

    def _fail_all(self, error: Exception) -> None:
        for rid, stream in list(self._streams.items()):
            try:
                self.engine.abort_request(rid)
            except Exception:  # a scheduler left mid-step by the failure
                pass
            stream.put(error)
            stream.done = True
        self._streams.clear()
        while True:  # requests not yet admitted
            try:
                kind, arg = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add" and not arg.done:
                arg.loop.call_soon_threadsafe(_set_exception, arg.admitted, error)
            elif kind == "stats":
                arg[0].call_soon_threadsafe(_set_exception, arg[1], error)


def _set_result(fut: asyncio.Future, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, error: BaseException) -> None:
    if not fut.done():
        fut.set_exception(error)

