"""SamplingParams.logprobs on the default model (CPU): each output token's log-probability is the
log_softmax of the logits that produced it (raw: before temperature), its rank is right, the top
alternatives come in order, speculation returns the same bits as plain decoding, and tokens cut by
a stop string take their logprobs with them."""
from __future__ import annotations

import math

import pytest
import torch

from pyengine import LLM, SamplingParams

PROMPTS = ["The capital of France is", "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3, 4, 5,"]


@pytest.fixture(scope="module")
def plain() -> LLM:
    return LLM(seed=0)


def run(llm: LLM, params: SamplingParams, record_logits: bool = False) -> list:
    llm.engine.cfg.record_logits = record_logits
    return llm.run_requests([(p, llm.tokenizer.encode(p)) for p in PROMPTS], [params] * len(PROMPTS))


def test_logprobs_are_the_log_softmax_of_the_committed_logits(plain: LLM) -> None:
    # temperature 0.8, seeded: logprobs stay those of the raw logits
    for req in run(plain, SamplingParams(temperature=0.8, seed=3, max_tokens=12, logprobs=4), record_logits=True):
        assert len(req.logprobs) == len(req.output_token_ids) == len(req.logits) == 12
        for token, entry, logits in zip(req.output_token_ids, req.logprobs, req.logits):
            ref = torch.log_softmax(logits.float(), -1)
            assert entry[token].logprob == float(ref[token])
            assert entry[token].rank == int((ref > ref[token]).sum()) + 1
            top = sorted((lp for lp in entry.values() if lp.rank <= 4), key=lambda lp: lp.rank)
            assert [lp.logprob for lp in top] == ref.topk(4).values.tolist()
            assert entry[token].decoded_token == plain.tokenizer.decode([token], skip_special_tokens=False)


def test_greedy_tokens_have_rank_1_and_logprobs_0_gives_only_the_token(plain: LLM) -> None:
    out = plain.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, logprobs=0), use_tqdm=False)
    for o in out:
        c = o.outputs[0]
        assert len(c.logprobs) == len(c.token_ids)
        for token, entry in zip(c.token_ids, c.logprobs):
            assert list(entry) == [token] and entry[token].rank == 1 and entry[token].logprob <= 0.0
    assert plain.generate(PROMPTS[0], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].logprobs is None


def test_speculation_returns_the_same_logprobs_bit_for_bit(plain: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=5)
    ref = plain.generate(PROMPTS, params, use_tqdm=False)
    spec = LLM(seed=0, speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    out = spec.generate(PROMPTS, params, use_tqdm=False)
    assert spec.stats()["num_accepted_tokens"] > 0
    for a, b in zip(ref, out):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs


def test_a_stop_string_cuts_the_logprobs_with_the_tokens(plain: LLM) -> None:
    out = plain.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=30, logprobs=1, stop=["9"]),
                         use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and len(out.logprobs) == len(out.token_ids) < 30
    assert all(math.isfinite(e[t].logprob) for t, e in zip(out.token_ids, out.logprobs))


@pytest.mark.parametrize("value", [-1, 21, True, 1.5, "3"])
def test_bad_logprobs_is_a_one_line_value_error(value) -> None:
    with pytest.raises(ValueError, match="logprobs must be None or an int in 0..20"):
        SamplingParams(logprobs=value)
