"""The engine end to end through `LLM`, on a tiny random Llama (GQA, untied head) on the CPU.

The reference for every greedy comparison is each prompt run alone through a default `LLM`; that
reference is itself checked against `tests.utils_paged.greedy_generate`, a decode loop that does not
use the C++ core. Scheduling choices (batching, chunking, prefix caching, preemption, block size)
must never change a single greedy token.
"""
from __future__ import annotations

import random
from typing import Any

import pytest

from pyengine import LLM, SamplingParams
from pyengine.outputs import RequestOutput
from tests.tiny_models import make_checkpoint
from tests.utils_paged import greedy_generate

MAX_TOKENS = 10
PROMPT_LENGTHS = (1, 3, 7, 12, 18, 25, 33, 40)
MAX_MODEL_LEN = 128  # the tiny model's context is 256; a smaller limit keeps "too long" prompts short


def _prompts() -> list[list[int]]:
    rng = random.Random(1234)
    return [[rng.randrange(3, 96) for _ in range(n)] for n in PROMPT_LENGTHS]


PROMPTS = _prompts()
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("tiny_llama_gqa_untied"))
    make_checkpoint("llama_gqa_untied", path)  # the same checkpoint test_models_hf checks against HF
    return path


def make_llm(path: str, **kwargs: Any) -> LLM:
    kwargs.setdefault("max_model_len", MAX_MODEL_LEN)
    return LLM(path, device="cpu", **kwargs)


@pytest.fixture(scope="module")
def llm(tiny_path: str) -> LLM:
    """A shared default LLM; tests that read stats() build their own."""
    return make_llm(tiny_path)


def token_ids(outputs: list[RequestOutput]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] = GREEDY) -> list[list[int]]:
    return token_ids(llm.generate(prompts, params, use_tqdm=False))


@pytest.fixture(scope="module")
def alone(llm: LLM) -> list[list[int]]:
    """Greedy tokens of each prompt, generated alone."""
    return [run(llm, [p])[0] for p in PROMPTS]


def test_reference_matches_paged_decode_loop(llm: LLM, alone: list[list[int]]) -> None:
    ref, _ = greedy_generate(llm.model, llm.model_config, PROMPTS, MAX_TOKENS, block_size=4)
    assert alone == ref
    assert all(len(t) == MAX_TOKENS for t in alone)
    assert len({tuple(t) for t in alone}) == len(alone)  # distinct prompts, distinct continuations


def test_mixed_length_batch_equals_alone(llm: LLM, alone: list[list[int]]) -> None:
    assert run(llm, PROMPTS) == alone
    # Another order and a duplicate: rows are independent of their neighbours.
    order = [5, 0, 7, 2, 2, 6, 1, 4, 3]
    assert run(llm, [PROMPTS[i] for i in order]) == [alone[i] for i in order]


def test_chunked_prefill_equals_one_prefill(tiny_path: str, alone: list[list[int]]) -> None:
    budget = 8
    small = make_llm(tiny_path, max_num_batched_tokens=budget)
    assert run(small, PROMPTS) == alone
    # The prompts really were split: no step carries more than `budget` tokens.
    assert small.stats()["num_steps"] >= -(-sum(PROMPT_LENGTHS) // budget)


@pytest.mark.parametrize("block_size", [1, 16])
def test_block_sizes(tiny_path: str, alone: list[list[int]], block_size: int) -> None:
    assert run(make_llm(tiny_path, block_size=block_size), PROMPTS) == alone


def test_prefix_caching_on_equals_off(tiny_path: str) -> None:
    rng = random.Random(7)
    prefix = [rng.randrange(3, 96) for _ in range(40)]
    first = [prefix + [rng.randrange(3, 96) for _ in range(3)]]
    second = [prefix + [rng.randrange(3, 96) for _ in range(n)] for n in (1, 5, 9)]
    results: dict[bool, list[list[int]]] = {}
    hits: dict[bool, int] = {}
    for enabled in (False, True):
        llm = make_llm(tiny_path, block_size=4, enable_prefix_caching=enabled)
        results[enabled] = run(llm, first)
        before = llm.stats()["prefix_cache_hit_tokens"]
        results[enabled] += run(llm, second)
        hits[enabled] = llm.stats()["prefix_cache_hit_tokens"] - before
    assert results[True] == results[False]
    assert hits[False] == 0
    # Each request of the second batch can reuse the 40-token prefix (10 full blocks of 4).
    assert hits[True] >= len(prefix)
    assert hits[True] % 4 == 0


def test_preemption_keeps_outputs(tiny_path: str, alone: list[list[int]]) -> None:
    block_size = 4
    need = [-(-(n + MAX_TOKENS) // block_size) for n in PROMPT_LENGTHS]
    num_blocks = max(need) + 2  # room for the longest request, far from room for all of them
    assert num_blocks < sum(need)
    llm = make_llm(tiny_path, block_size=block_size, num_kv_blocks=num_blocks)
    assert run(llm, PROMPTS) == alone
    assert llm.stats()["num_preemptions"] > 0


def test_max_tokens_and_length_reason(llm: LLM, alone: list[list[int]]) -> None:
    for n in (1, 4):
        outs = llm.generate(PROMPTS[:3], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [a[:n] for a in alone[:3]]
        assert all(o.outputs[0].finish_reason == "length" and o.finished for o in outs)


def _step3_case(alone: list[list[int]]) -> tuple[int, int]:
    """A prompt whose greedy token at step 3 did not appear at steps 1-2: (prompt index, token)."""
    for i, toks in enumerate(alone):
        if toks[2] not in toks[:2]:
            return i, toks[2]
    raise AssertionError("no prompt has a fresh token at step 3")


def test_stop_token_ids(llm: LLM, alone: list[list[int]]) -> None:
    i, tok = _step3_case(alone)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop_token_ids=[tok])
    out = llm.generate([PROMPTS[i]], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == alone[i][:3]  # the stop token is kept, as in vLLM
    assert out.finish_reason == "stop"


def test_stop_string(llm: LLM, alone: list[list[int]]) -> None:
    i, tok = _step3_case(alone)
    full = llm.generate([PROMPTS[i]], GREEDY, use_tqdm=False)[0].outputs[0].text
    head = llm.tokenizer.decode(alone[i][:2])
    stop = " " + llm.tokenizer.decode([tok]) + " "  # the tiny vocab is "t0".."t95", space-separated
    assert full.find(stop) == len(head), "the stop string must first occur at step 3"
    out = llm.generate([PROMPTS[i]], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop=stop),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop"
    assert out.text == head  # the stop string is not part of the text
    assert out.token_ids == alone[i][: len(out.token_ids)] and len(out.token_ids) < MAX_TOKENS


def test_per_request_error_does_not_fail_the_batch(llm: LLM, alone: list[list[int]]) -> None:
    too_long = [5] * (MAX_MODEL_LEN - MAX_TOKENS + 1)
    bad_token = [4, 10_000]
    outs = llm.generate([PROMPTS[3], too_long, PROMPTS[7], bad_token], GREEDY, use_tqdm=False)
    assert [outs[0].outputs[0].token_ids, outs[2].outputs[0].token_ids] == [alone[3], alone[7]]
    assert outs[0].error is None and outs[0].outputs[0].finish_reason == "length"
    for o, word in ((outs[1], "max_model_len"), (outs[3], "token ids")):
        assert o.outputs[0].finish_reason == "error"
        assert o.outputs[0].token_ids == []
        assert o.error is not None and word in o.error
    # The engine is still usable afterwards.
    assert run(llm, [PROMPTS[0]]) == [alone[0]]


@pytest.mark.parametrize("call,match", [
    (lambda llm, path: LLM(path, device="cpu", block_size=0), "block_size"),
    (lambda llm, path: LLM(path, device="cpu", num_kv_blocks=-1), "num_kv_blocks"),
    (lambda llm, path: LLM(path, device="cpu", max_model_len=10**6), "max_model_len"),
    (lambda llm, path: SamplingParams(top_p=2), "top_p"),
    (lambda llm, path: SamplingParams(temperature=-1), "temperature"),
    (lambda llm, path: SamplingParams(max_tokens=0), "max_tokens"),
    (lambda llm, path: llm.generate([], GREEDY), "prompts"),
    (lambda llm, path: llm.generate([""], GREEDY), "prompt 0 is empty"),
    (lambda llm, path: llm.generate([[1, 2], []], GREEDY), "prompt 1"),
    (lambda llm, path: llm.generate([[1], [2]], [GREEDY]), "sampling_params"),
], ids=["block_size", "num_kv_blocks", "max_model_len", "top_p", "temperature", "max_tokens", "no_prompts",
        "empty_str", "empty_ids", "params_count"])
def test_invalid_arguments_raise(llm: LLM, tiny_path: str, call: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call(llm, tiny_path)


def test_stats_are_consistent(tiny_path: str, alone: list[list[int]]) -> None:
    llm = make_llm(tiny_path)
    fresh = llm.stats()
    for key in ("num_steps", "num_preemptions", "prefix_cache_hit_tokens", "prompt_tokens", "generated_tokens"):
        assert fresh[key] == 0, key
    lengths = [MAX_TOKENS, 3, 7, 1, 5, 2, 9, 4]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    outs = run(llm, PROMPTS, params)
    assert [len(t) for t in outs] == lengths
    s = llm.stats()
    assert s["generated_tokens"] == sum(lengths)
    assert s["prompt_tokens"] == sum(PROMPT_LENGTHS)
    assert s["num_preemptions"] == 0
    assert s["prefix_cache_hit_tokens"] == 0  # no two prompts share a block
    # One token per running request per step (no speculation): at least max(lengths) steps, and
    # at most one step per generated token.
    assert max(lengths) <= s["num_steps"] <= sum(lengths)
    # Counters accumulate over generate() calls.
    run(llm, PROMPTS[:2])
    s2 = llm.stats()
    assert s2["generated_tokens"] == s["generated_tokens"] + 2 * MAX_TOKENS
    assert s2["prompt_tokens"] == s["prompt_tokens"] + sum(PROMPT_LENGTHS[:2])
    assert s2["num_steps"] >= s["num_steps"] + MAX_TOKENS


def _sampled(seed: int | None, temperature: float = 1.0) -> SamplingParams:
    return SamplingParams(temperature=temperature, seed=seed, max_tokens=MAX_TOKENS, ignore_eos=True)


def test_seeded_sampling_is_reproducible(llm: LLM, tiny_path: str) -> None:
    p = PROMPTS[4]
    a = run(llm, [p], _sampled(11))[0]
    assert run(llm, [p], _sampled(11))[0] == a
    assert run(make_llm(tiny_path, seed=99), [p], _sampled(11))[0] == a  # the request seed wins
    others = {tuple(run(llm, [p], _sampled(s))[0]) for s in range(12, 16)}
    assert len(others | {tuple(a)}) > 1, "the seed must change what is sampled"


def test_seeded_request_independent_of_batch(llm: LLM, tiny_path: str) -> None:
    seeded = _sampled(2024, temperature=1.5)
    target = PROMPTS[5]
    solo = run(llm, [target], seeded)[0]
    batch = [PROMPTS[0], PROMPTS[6], target, PROMPTS[2], PROMPTS[7]]
    params = [_sampled(None, 1.5), _sampled(5), seeded, GREEDY, _sampled(None, 0.7)]
    assert run(llm, batch, params)[2] == solo
    # Also with chunked prefill and a pool small enough to preempt (other batch shapes every step).
    tight = make_llm(tiny_path, max_num_batched_tokens=8, block_size=4, num_kv_blocks=20)
    assert run(tight, batch, params)[2] == solo
    assert tight.stats()["num_preemptions"] > 0


def test_engine_seed_reproducible(tiny_path: str) -> None:
    """Unseeded requests derive their seed from the engine seed: two fresh engines agree."""
    params = _sampled(None)
    a = run(make_llm(tiny_path, seed=3), PROMPTS[:4], params)
    b = run(make_llm(tiny_path, seed=3), PROMPTS[:4], params)
    assert a == b
    assert all(len(t) == MAX_TOKENS for t in a)


@pytest.mark.parametrize("spec", [None, {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}])
def test_finished_requests_leave_the_engine(tiny_path: str, spec: dict | None) -> None:
    """A finished request is returned by the step that finishes it (and by generate), then the
    engine forgets it: by length, stop id, stop string and a request rejected at admission."""
    llm = make_llm(tiny_path, speculative_config=spec)
    engine = llm.engine
    prompts = _prompts()
    stop_id = run(llm, prompts[:1], SamplingParams(temperature=0, max_tokens=8))[0][3]
    params = [SamplingParams(temperature=0, max_tokens=12), SamplingParams(temperature=0, stop_token_ids=[stop_id]),
              SamplingParams(temperature=0.8, seed=3, stop=["a"], max_tokens=20)]
    reqs = [engine.add_request(p, params[i % len(params)]) for i, p in enumerate(prompts)]
    rejected = engine.add_request([engine.model_config.vocab_size], GREEDY)
    assert rejected.finished and rejected.request_id not in engine.requests
    returned: list[int] = []
    while engine.has_unfinished():
        touched = engine.step()
        returned += [r.request_id for r in touched if r.finished]
        assert not any(rid in engine.requests for rid in returned), "a returned finished request stayed"
    assert sorted(returned) == sorted(r.request_id for r in reqs) and not engine.requests
    assert len(engine.generators) == 0
    outs = llm.generate(prompts, params[0], use_tqdm=False)
    assert all(o.outputs[0].finish_reason == "length" for o in outs) and not engine.requests


def test_streamed_requests_equal_requests_filled_at_finish(llm: LLM) -> None:
    """A streamed request gets its tokens and text every step; the others get them once, from the
    scheduler, when they finish: both give the same tokens and text (the full decode of the
    tokens), and only streamed requests are touched by steps that do not finish them."""
    params = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS + i, ignore_eos=True) for i in range(len(PROMPTS))]
    encoded = [(None, p) for p in PROMPTS]
    outs = {}
    for stream in (False, True):
        touched_unfinished = []
        reqs = llm.run_requests(encoded, params, lambda t: touched_unfinished.extend(r for r in t if not r.finished),
                                stream=stream)
        outs[stream] = [(r.output_token_ids, r.text, r.finish_reason) for r in reqs]
        assert bool(touched_unfinished) == stream
    assert outs[False] == outs[True]
    for (ids, text, reason), p in zip(outs[False], params):
        assert len(ids) == p.max_tokens and reason == "length"
        assert text == llm.tokenizer.decode(ids)


def test_no_progress_bar_when_stderr_is_not_a_terminal(llm: LLM, capsys) -> None:
    llm.generate(PROMPTS[:2], GREEDY)  # use_tqdm defaults to True; pytest's captured stderr is no terminal
    assert "Generating" not in capsys.readouterr().err
