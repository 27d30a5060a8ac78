"""The OpenAI-compatible server (pyengine.entrypoints.openai) with the real `openai` client, on the
default model: uvicorn in a background thread on a free 127.0.0.1 port, one server plain and one
with ngram speculation (module-scoped), stopped cleanly at the end."""
from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
import time

import pytest

fastapi = pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from pyengine import LLM, SamplingParams  # noqa: E402
from pyengine.engine.async_llm import AsyncLLM  # noqa: E402
from pyengine.entrypoints.openai.api_server import DEFAULT_MODEL_NAME, build_app  # noqa: E402

PROMPT = "Once upon a time, by the sea,"
QUESTION = [{"role": "user", "content": "Name three colours of the rainbow, one per line."}]


class Server:
    def __init__(self, llm: LLM) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.engine = AsyncLLM(llm)
        app = build_app(self.engine, DEFAULT_MODEL_NAME)
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.time() + 30
        while not self.server.started:
            assert time.time() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.05)
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=60)
        self.aclient = openai.AsyncOpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=120)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        assert not self.thread.is_alive(), "the server did not stop"
        assert not self.engine._thread.is_alive(), "the engine loop did not stop"

    def metrics(self) -> dict[str, float]:
        text = httpx.get(self.url + "/metrics", timeout=10).text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[re.sub(r'model_name="[^"]*",?', "", name).replace("{}", "")] = float(value)
        return out


@pytest.fixture(scope="module")
def plain_llm():
    return LLM(seed=0)


@pytest.fixture(scope="module")
def server(plain_llm):
    s = Server(plain_llm)  # from here on only the server's loop thread touches plain_llm's engine
    yield s
    s.stop()


@pytest.fixture(scope="module")
def spec_server():
    s = Server(LLM(seed=0, speculative_config={"method": "ngram", "num_speculative_tokens": 4}))
    yield s
    s.stop()


def _complete(s: Server, stream: bool, **kw) -> tuple[str, str | None]:
    if not stream:
        r = s.client.completions.create(model=DEFAULT_MODEL_NAME, prompt=PROMPT, **kw)
        return r.choices[0].text, r.choices[0].finish_reason
    text, reason = "", None
    for chunk in s.client.completions.create(model=DEFAULT_MODEL_NAME, prompt=PROMPT, stream=True, **kw):
        if chunk.choices:
            text += chunk.choices[0].text
            reason = chunk.choices[0].finish_reason or reason
    return text, reason


def _chat(s: Server, stream: bool, **kw) -> tuple[str, str | None]:
    if not stream:
        r = s.client.chat.completions.create(model=DEFAULT_MODEL_NAME, messages=QUESTION, **kw)
        return r.choices[0].message.content, r.choices[0].finish_reason
    text, reason = "", None
    for chunk in s.client.chat.completions.create(model=DEFAULT_MODEL_NAME, messages=QUESTION, stream=True, **kw):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            reason = chunk.choices[0].finish_reason or reason
    return text, reason


def test_engine_abort_request_frees_blocks_at_once(plain_llm):
    """Runs before the plain server starts on the same LLM."""
    llm = plain_llm
    eng = llm.engine
    total = eng.cfg.num_kv_blocks
    ids = llm.tokenizer.encode(PROMPT)
    req = eng.add_request(ids, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True), stream=True)
    for _ in range(3):
        eng.step()
    assert eng.scheduler.num_free_blocks < total and req.output_token_ids
    assert eng.abort_request(req.request_id) and not eng.abort_request(req.request_id)
    assert req.finish_reason == "abort" and eng.scheduler.num_free_blocks == total and not eng.has_unfinished()
    assert not eng.requests and not eng.outputs.streamed and req.request_id not in eng.generators
    # the engine runs on
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 5


def test_models_health_and_usage(server):
    assert httpx.get(server.url + "/health").status_code == 200
    assert [m.id for m in server.client.models.list().data] == [DEFAULT_MODEL_NAME]
    chunks = list(server.client.completions.create(model=DEFAULT_MODEL_NAME, prompt=PROMPT, max_tokens=8,
                                                   temperature=0, stream=True, extra_body={"ignore_eos": True},
                                                   stream_options={"include_usage": True}))
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8
    r = server.client.completions.create(model=DEFAULT_MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 8 and r.usage.prompt_tokens == chunks[-1].usage.prompt_tokens


@pytest.mark.parametrize("which", ["plain", "ngram"])
def test_streamed_equals_non_streamed_at_temperature_0(which, request):
    s = request.getfixturevalue("server" if which == "plain" else "spec_server")
    outs = {}
    for kind, fn in (("completion", _complete), ("chat", _chat)):
        plain = fn(s, False, max_tokens=40, temperature=0)
        streamed = fn(s, True, max_tokens=40, temperature=0)
        assert plain == streamed and plain[0], (kind, plain, streamed)
        outs[kind] = plain
    # stop strings cut the same text, streamed or not
    stop = outs["completion"][0].split()[3]
    assert _complete(s, False, max_tokens=40, temperature=0, stop=[stop]) == \
        _complete(s, True, max_tokens=40, temperature=0, stop=[stop])
    if which == "ngram":  # lossless: the same text as the plain server's
        assert s.metrics()["pyengine:spec_decode_num_draft_tokens_total"] > 0


def test_speculation_is_lossless_over_http(server, spec_server):
    for fn in (_complete, _chat):
        assert fn(server, False, max_tokens=40, temperature=0) == fn(spec_server, False, max_tokens=40, temperature=0)


def test_sampled_with_seed_and_n(server):
    kw = dict(model=DEFAULT_MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0.8, top_p=0.9, seed=7)
    a = server.client.completions.create(n=3, extra_body={"top_k": 50}, **kw)
    b = server.client.completions.create(n=3, extra_body={"top_k": 50}, **kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert 3 <= a.usage.completion_tokens <= 36


def test_32_concurrent_streams(server):
    async def one(i: int) -> tuple[str, str | None]:
        stream = await server.aclient.chat.completions.create(
            model=DEFAULT_MODEL_NAME, messages=[{"role": "user", "content": f"Count from {i} to {i + 5}."}],
            max_tokens=16, temperature=0, stream=True)
        text, reason = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                reason = chunk.choices[0].finish_reason or reason
        return text, reason

    async def main():
        return await asyncio.gather(*(one(i) for i in range(32)))

    results = asyncio.run(main())
    assert len(results) == 32 and all(reason in ("stop", "length") and text for text, reason in results)


def test_disconnect_aborts_and_frees_blocks(server):
    before = server.metrics()
    assert before["pyengine:kv_cache_usage_perc"] == 0.0
    body = {"prompt": PROMPT, "max_tokens": 4000, "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=30) as c:
        with c.stream("POST", server.url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = 0
            for line in lines:
                if line.startswith("data: "):
                    got += 1
                    if got == 3:
                        break
            assert server.metrics()["pyengine:kv_cache_usage_perc"] > 0
    deadline = time.time() + 10
    while True:
        m = server.metrics()
        if m["pyengine:kv_cache_usage_perc"] == 0.0 and m["pyengine:num_requests_running"] == 0:
            break
        assert time.time() < deadline, f"blocks not freed after the client left: {m}"
        time.sleep(0.1)
    key = 'pyengine:request_success_total{finished_reason="abort"}'
    assert m[key] == before[key] + 1
    assert m["pyengine:generation_tokens_total"] - before["pyengine:generation_tokens_total"] < 4000


def test_completion_logprobs_streamed_equal_not_streamed(server):
    kw = dict(model=DEFAULT_MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0, logprobs=3)
    r = server.client.completions.create(**kw).choices[0]
    lp = r.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 12
    assert "".join(lp.tokens) == r.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(12)]
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) <= 3 and max(top.values()) == value and top[token] == value  # greedy: the top token
    streamed = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for chunk in server.client.completions.create(stream=True, **kw):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            for key in streamed:
                streamed[key] += getattr(chunk.choices[0].logprobs, key)
    assert streamed == {key: getattr(lp, key) for key in streamed}


def test_chat_logprobs_streamed_equal_not_streamed(server):
    kw = dict(model=DEFAULT_MODEL_NAME, messages=QUESTION, max_tokens=10, temperature=0, logprobs=True, top_logprobs=2)
    r = server.client.chat.completions.create(**kw).choices[0]
    content = [c.model_dump() for c in r.logprobs.content]
    assert len(content) == 10 and "".join(c["token"] for c in content) == r.message.content
    for c in content:
        assert len(c["top_logprobs"]) == 2 and c["top_logprobs"][0]["logprob"] == c["logprob"]
        assert bytes(c["bytes"]).decode() == c["token"]
    streamed = []
    for chunk in server.client.chat.completions.create(stream=True, **kw):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += [c.model_dump() for c in chunk.choices[0].logprobs.content]
    assert streamed == content
    plain = server.client.chat.completions.create(model=DEFAULT_MODEL_NAME, messages=QUESTION, max_tokens=4)
    assert plain.choices[0].logprobs is None


BAD_REQUESTS = [
    ("chat", {"max_tokens": 5}, "messages"),
    ("chat", {"messages": []}, "messages"),
    ("chat", {"messages": [{"role": "user"}]}, "messages"),
    ("chat", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    ("chat", {"messages": QUESTION, "top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
    ("chat", {"messages": QUESTION, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat", {"messages": QUESTION, "max_tokens": 0}, "max_tokens"),
    ("completions", {"prompt": PROMPT, "max_tokens": -1}, "max_tokens"),
    ("completions", {"prompt": PROMPT, "temperature": "x"}, "temperature"),
    ("completions", {"prompt": PROMPT, "temperature": -1}, "temperature"),
    ("completions", {"prompt": PROMPT, "top_p": 0}, "top_p"),
    ("completions", {"prompt": PROMPT, "top_k": -5}, "top_k"),
    ("completions", {"prompt": PROMPT, "seed": "abc"}, "seed"),
    ("completions", {"prompt": PROMPT, "stop": [""]}, "stop"),
    ("completions", {"prompt": PROMPT, "n": 1000}, "n"),
    ("completions", {"prompt": PROMPT, "logprobs": 21}, "logprobs"),
    ("completions", {"prompt": PROMPT, "logprobs": -1}, "logprobs"),
    ("completions", {"prompt": PROMPT, "presence_penalty": 1.0}, "presence_penalty"),
    ("completions", {"prompt": [10**7, 5]}, "prompt"),
    ("completions", {"prompt": ""}, "prompt"),
    ("completions", {"prompt": PROMPT, "max_tokens": 10**6}, "prompt"),
    ("completions", {"prompt": PROMPT, "max_tokens": 10**6, "stream": True}, "prompt"),
    ("completions", {}, "prompt"),
]


def test_bad_requests_get_400_and_the_server_keeps_serving(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        for endpoint, body, param in BAD_REQUESTS:
            r = c.post(f"/v1/{'chat/completions' if endpoint == 'chat' else 'completions'}", json=body)
            assert r.status_code == 400, (body, r.status_code, r.text)
            err = r.json()["error"]
            assert err["type"] == "invalid_request_error" and err["message"] and err["code"] is None, err
            assert err["param"] is not None and err["param"].startswith(param), (body, err)
        r = c.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        r = c.post("/v1/completions", json={"model": "gpt-4o", "prompt": PROMPT})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError):
        server.client.chat.completions.create(model=DEFAULT_MODEL_NAME, messages=QUESTION, max_tokens=-1)
    # still serving, nothing left behind
    assert _complete(server, False, max_tokens=4, temperature=0)[0]
    m = server.metrics()
    assert m["pyengine:kv_cache_usage_perc"] == 0.0 and m["pyengine:num_requests_running"] == 0
    assert m["pyengine:http_requests_refused_total"] >= len(BAD_REQUESTS)


def test_async_llm_generate_streams_deltas(server):
    async def main():
        texts, ids, outs = [], [], []
        async for out in server.engine.generate(PROMPT, SamplingParams(temperature=0, max_tokens=10)):
            texts.append(out.outputs[0].text)
            ids += out.outputs[0].token_ids
            outs.append(out)
        return "".join(texts), ids, outs

    text, ids, outs = asyncio.run(main())
    assert len(ids) == 10 and outs[-1].finished and not any(o.finished for o in outs[:-1]) and len(outs) > 1
    ref = _complete(server, False, max_tokens=10, temperature=0)[0]
    assert text == ref
    assert json.dumps(outs[-1].metrics)  # arrival / ttft figures are plain floats


def test_generation_that_fails_while_running_is_a_500():
    """A request whose logits turn non-finite (one token's embedding poisoned with NaN) ends with the
    engine's error: non-streamed it is an HTTP 500 server_error naming it, not a 200; a request
    without that token still succeeds on the same server."""
    from tests.test_nonfinite_logits import nan_embedding

    llm = LLM(seed=0)
    bad = llm.tokenizer.encode(" sea", add_special_tokens=False)[-1]
    with nan_embedding(llm, bad):  # for the server's whole life
        s = Server(llm)
        try:
            r = httpx.post(s.url + "/v1/completions", json={"prompt": "by the sea", "max_tokens": 4}, timeout=60)
            assert r.status_code == 500, r.text
            err = r.json()["error"]
            assert err["type"] == "server_error" and "non-finite logits" in err["message"], err
            ok = httpx.post(s.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 4}, timeout=60)
            assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] in ("length", "stop")
        finally:
            s.stop()
