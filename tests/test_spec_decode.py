"""Greedy speculative decoding equals plain decoding, token for token, on every path: ragged drafts,
mixed prefill + verify batches, block sizes 1..16, k up to 8 (k >= block_size), prefix caching on
and off, preemption, and every acceptance count forced by a scripted proposer."""
from __future__ import annotations

import functools
import random
from typing import Callable

import pytest
import torch

from pyengine import SamplingParams
from tests.scripted_proposer import make_llm
from tests.spec_harness import RecordingScheduler, assert_lossless, run
from tests.tiny_models import VOCAB, make_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tiny_llama"))
    make_checkpoint("llama_gqa_untied", path)
    return path


def make_prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Mixed lengths; half repeat a short pattern so prompt lookup finds matches."""
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        length = rng.randint(1, 40)
        if i % 2 == 0:
            pattern = [rng.randrange(3, VOCAB) for _ in range(rng.randint(2, 5))]
            prompts.append((pattern * 20)[:length])
        else:
            prompts.append([rng.randrange(3, VOCAB) for _ in range(length)])
    return prompts


@functools.lru_cache(maxsize=None)
def plain_reference(path: str, n: int, max_tokens: int) -> list[list[int]]:
    outs, _, _, _ = run(path, make_prompts(n), max_tokens=max_tokens)
    return outs


@pytest.mark.parametrize("batch,block_size,k,prefix", [
    (1, 16, 1, True), (8, 1, 3, True), (8, 2, 8, False), (32, 16, 4, True), (32, 2, 5, True), (16, 4, 8, False),
])
def test_ngram_greedy_equals_plain(tiny: str, batch: int, block_size: int, k: int, prefix: bool) -> None:
    prompts = make_prompts(batch)
    plain = plain_reference(tiny, batch, 24)
    spec = {"method": "ngram", "adaptive_draft_length": False, "num_speculative_tokens": k, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    outs, stats, rec, llm = run(tiny, prompts, spec=spec, block_size=block_size, enable_prefix_caching=prefix,
                                max_num_batched_tokens=64)
    assert_lossless(llm, prompts, plain, outs)
    assert stats["num_accepted_tokens"] > 0, "speculation never accepted anything: the test proves nothing"
    if batch > 1:
        assert rec.had_ragged_step(), "no step mixed rows with drafts and rows without"


def run_with_fixed_policy(tiny: str, prompts: list[list[int]], plain: list[list[int]], k: int,
                          wrong: Callable[[int], bool], per_token_s: float, params: SamplingParams,
                          every_row_may_finish_last: bool = False) -> RecordingScheduler:
    """Scripted drafts, all right except for the requests `wrong` picks (all wrong), under a
    DraftLengthPolicy whose step-time line is fixed (10 ms + per_token_s per token), so the lengths
    depend on acceptance alone, not on this machine's timing. The output must equal plain
    decoding; returns the recorded steps."""
    from pyengine.spec_decode.draft_length import DraftLengthPolicy

    reference = {i: (len(p), out) for i, (p, out) in enumerate(zip(prompts, plain))}

    def script(seq_id: int, tokens: list[int]) -> list[int]:
        prompt_len, ref = reference[seq_id]
        good = ref[len(tokens) - prompt_len:][:k]
        return [(t + 1) % VOCAB for t in good] if wrong(seq_id) else good

    llm = make_llm(tiny, {"method": "scripted", "num_speculative_tokens": k, "script": script},
                   device="cpu", block_size=4)
    policy = DraftLengthPolicy(k)
    for n in (4 * k, 10 * k, 4 * k, 10 * k):
        policy.observe_step(n, 0.010 + per_token_s * n)
    policy.steps = 4  # past the warm-up
    policy.observe_step = lambda num_tokens, seconds: None  # type: ignore[method-assign]
    llm.engine.draft_length = policy  # (scripted drafts are otherwise never shortened)
    if every_row_may_finish_last:
        llm.engine._can_finish_last = lambda view: None  # type: ignore[method-assign]
    rec = RecordingScheduler(llm.engine.scheduler)
    llm.engine.scheduler = rec
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert outs == plain
    return rec


def test_per_request_draft_lengths_equal_plain(tiny: str) -> None:
    """The adaptive policy gives each request its own length in the same step: requests whose
    drafts are always right keep k, requests whose drafts are always wrong get none; the output is
    unchanged. Every row may finish last here (lengths by acceptance alone; the next test covers
    the rule that rows which cannot finish last get no drafts)."""
    k, prompts = 4, make_prompts(8, seed=7)
    plain = run(tiny, prompts, max_tokens=40)[0]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    # verify tokens cost compute: 1 ms per token
    rec = run_with_fixed_policy(tiny, prompts, plain, k, lambda sid: sid % 2 == 1, 0.001, params,
                                every_row_may_finish_last=True)
    late = [s for s in rec.steps[6:] if s.num_decode_rows == len(s.num_drafts) == 8]
    assert len(late) >= 3, "too few steps with all 8 requests decoding"
    for s in late:  # rows are in admission order: even seq ids accept everything
        assert (s.num_drafts[0:8:2] >= k - 1).all() and (s.num_drafts[1:8:2] == 0).all(), s.num_drafts


def test_rows_that_cannot_finish_last_get_no_drafts(tiny: str) -> None:
    """Fixed-length requests (ignore_eos, no stops), none waiting: request 0's drafts are always
    wrong, so it needs every step and finishes last; the others accept everything, run ahead, and
    from then on get no drafts (their early tokens could not shorten the run). With a stop token
    id, a request may end any time, so every row may finish last and keeps its drafts."""
    k, prompts = 4, make_prompts(4, seed=3)
    plain = run(tiny, prompts, max_tokens=32)[0]
    for stop_ids, ahead_rows_draft in ((None, False), ([VOCAB + 7], True)):
        params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, stop_token_ids=stop_ids)
        # 0.1 ms per token: drafts that are accepted pay
        rec = run_with_fixed_policy(tiny, prompts, plain, k, lambda sid: sid == 0, 0.0001, params)
        # After the first few steps, and before the last (where the drafts left are capped by
        # max_tokens).
        late = [s for s in rec.steps if s.num_decode_rows == len(s.num_drafts) == 4][3:-1]
        assert late, "no step with all 4 requests decoding after the first few"
        ahead = [s.num_drafts[1:] for s in late]
        if ahead_rows_draft:
            assert all((d >= k - 1).all() for d in ahead), ahead
        else:
            assert all((d == 0).all() for d in ahead), ahead


def test_ngram_with_preemption_equals_plain(tiny: str) -> None:
    prompts = make_prompts(8)
    plain = plain_reference(tiny, 8, 24)
    spec = {"method": "ngram", "adaptive_draft_length": False, "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    outs, stats, rec, llm = run(tiny, prompts, spec=spec, block_size=4, num_kv_blocks=24)
    assert stats["num_preemptions"] > 0
    assert_lossless(llm, prompts, plain, outs)


def scripted(reference: dict[int, tuple[int, list[int]]], k: int, pattern: list[int]):
    """Drafts the true continuation for `a` tokens, then wrong tokens; a cycles through `pattern`."""
    calls: dict[int, int] = {}

    def script(seq_id: int, tokens: list[int]) -> list[int]:
        prompt_len, ref = reference[seq_id]
        i = calls.get(seq_id, 0)
        calls[seq_id] = i + 1
        a = pattern[(i + seq_id) % len(pattern)]  # offset per request: rows differ within a step
        if a < 0:
            return []  # a step with no drafts at all
        done = len(tokens) - prompt_len
        good = ref[done:done + a]
        wrong = [(t + 1) % VOCAB for t in ref[done + len(good):done + k]] or [0]
        return (good + wrong * k)[:k]

    return script


@pytest.mark.parametrize("block_size,k", [(4, 3), (4, 4), (2, 5), (1, 3)])
def test_scripted_every_acceptance_count(tiny: str, block_size: int, k: int) -> None:
    prompts = make_prompts(6, seed=1)
    plain = run(tiny, prompts, max_tokens=40)[0]
    reference = {i: (len(p), out) for i, (p, out) in enumerate(zip(prompts, plain))}
    spec = {"method": "scripted", "num_speculative_tokens": k, "script": scripted(reference, k, list(range(k + 1)))}
    outs, stats, rec, llm = run(tiny, prompts, max_tokens=40, spec=spec, block_size=block_size)
    assert outs == plain
    full = [(nc, n, d, c) for nc, n, d, c in rec.verify_rows() if d == k]
    assert {c - 1 for *_, c in full} == set(range(k + 1)), "not every acceptance count 0..k occurred"
    assert any(nc % block_size == 0 for nc, *_ in full), "no verify step started at a block boundary"
    assert any((nc + n - 1) // block_size - nc // block_size >= 1 for nc, n, *_ in full), "none crossed a boundary"


def test_regression_k_plus_one_crosses_several_block_boundaries(tiny: str) -> None:
    prompts = make_prompts(4, seed=2)
    plain = run(tiny, prompts, max_tokens=40)[0]
    reference = {i: (len(p), out) for i, (p, out) in enumerate(zip(prompts, plain))}
    spec = {"method": "scripted", "num_speculative_tokens": 7, "script": scripted(reference, 7, [7])}
    outs, _, rec, _ = run(tiny, prompts, max_tokens=40, spec=spec, block_size=2)
    assert outs == plain
    assert any((nc + n - 1) // 2 - nc // 2 >= 3 for nc, n, *_ in rec.verify_rows())


def test_regression_step_without_drafts_right_after_an_accepted_run(tiny: str) -> None:
    prompts = make_prompts(6, seed=3)
    plain = run(tiny, prompts, max_tokens=32)[0]
    reference = {i: (len(p), out) for i, (p, out) in enumerate(zip(prompts, plain))}
    # all accepted, then no drafts at all, then partial, then none again
    spec = {"method": "scripted", "num_speculative_tokens": 3, "script": scripted(reference, 3, [3, -1, 1, -1])}
    outs, _, rec, _ = run(tiny, prompts, max_tokens=32, spec=spec, block_size=4)
    assert outs == plain
    assert rec.had_ragged_step()


def test_regression_mixed_prefill_and_verify_batch(tiny: str) -> None:
    prompts = make_prompts(8, seed=4)
    plain = run(tiny, prompts, max_tokens=24)[0]
    reference = {i: (len(p), out) for i, (p, out) in enumerate(zip(prompts, plain))}
    spec = {"method": "scripted", "num_speculative_tokens": 3, "script": scripted(reference, 3, [2, 3, 0])}
    # a small budget keeps later prompts prefilling (in chunks) while earlier ones verify
    outs, _, rec, _ = run(tiny, prompts, max_tokens=24, spec=spec, block_size=4, max_num_batched_tokens=12,
                          max_num_seqs=8)
    assert outs == plain
    assert rec.had_mixed_step(), "no step mixed prefill chunks with verify rows"


def test_regression_stop_inside_an_accepted_run(tiny: str) -> None:
    prompts = make_prompts(4, seed=5)
    plain = run(tiny, prompts, max_tokens=30)[0]
    stop_id = plain[0][5]  # the 6th token of the first request stops it
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[stop_id])
    plain_stop = run(tiny, prompts, params=params)[0]
    reference = {i: (len(p), out) for i, (p, out) in enumerate(zip(prompts, plain))}
    spec = {"method": "scripted", "num_speculative_tokens": 8, "script": scripted(reference, 8, [8])}
    outs, _, _, llm = run(tiny, prompts, params=params, spec=spec, block_size=4)
    assert outs == plain_stop
    assert outs[0][-1] == stop_id and len(outs[0]) <= 6


def test_regression_preemption_of_a_request_with_pending_drafts(tiny: str) -> None:
    prompts = make_prompts(8, seed=6)
    plain = run(tiny, prompts, max_tokens=32)[0]
    reference = {i: (len(p), out) for i, (p, out) in enumerate(zip(prompts, plain))}
    spec = {"method": "scripted", "num_speculative_tokens": 4, "script": scripted(reference, 4, [4, 2, 0])}
    outs, stats, _, _ = run(tiny, prompts, max_tokens=32, spec=spec, block_size=4, num_kv_blocks=22)
    assert stats["num_preemptions"] > 0
    assert outs == plain


def test_smollm2_ngram_greedy_equals_plain(smollm2_path: str) -> None:
    from pyengine import LLM

    text = ("def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"
            "Rewrite the two functions above with type hints, keeping the names:\n")
    plain_llm = LLM(device="cpu", max_model_len=512)
    tok = plain_llm.tokenizer
    prompts = [tok.encode(text), tok.encode("The quick brown fox jumps over the lazy dog. The quick brown"),
               tok.encode("Once upon a time")]
    params = SamplingParams(temperature=0, max_tokens=32)
    plain = [o.outputs[0].token_ids for o in plain_llm.generate(prompts, params, use_tqdm=False)]
    spec = {"method": "ngram", "adaptive_draft_length": False, "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    outs, stats, _, llm = run(None, prompts, spec=spec, params=params, max_model_len=512)
    assert_lossless(llm, prompts, plain, outs)
    assert stats["num_accepted_tokens"] > 0


def test_bf16_cpu_spec_equals_plain_exactly(tiny: str) -> None:
    """bf16 on the CPU: every op of the decode path (pyengine's GEMM on avx512_bf16 CPUs, the C++
    attention, norms, RoPE) computes a token the same way whatever else is in the step, so ngram
    speculation at batch 8 must reproduce plain decoding exactly, without even a near-tie."""
    from pyengine.ops.cpu import PackedLinear

    prompts = make_prompts(8, seed=3)
    plain, _, _, llm = run(tiny, prompts, max_tokens=24, dtype="bfloat16")
    if not PackedLinear.supported(torch.zeros(2, 2, dtype=torch.bfloat16)):
        pytest.skip("CPU lacks avx512_bf16: the bf16 linears run oneDNN, whose kernels vary with M")
    assert isinstance(llm.model.layers[0].qkv_proj, PackedLinear)
    spec = {"method": "ngram", "adaptive_draft_length": False, "num_speculative_tokens": 4,
            "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    outs, stats, rec, _ = run(tiny, prompts, max_tokens=24, spec=spec, dtype="bfloat16", block_size=4)
    assert stats["num_accepted_tokens"] > 0 and rec.had_ragged_step()
    assert outs == plain


def test_regression_stop_string_inside_an_accepted_run(tiny: str) -> None:
    """A stop string completed inside an accepted draft run: the tokens after the one that
    completed it are dropped, so token_ids, text and finish reason equal plain decoding's."""
    prompts = make_prompts(4, seed=7)
    plain = run(tiny, prompts, max_tokens=30)[0]
    llm = make_llm(tiny, None, device="cpu")
    stop = llm.tokenizer.decode(plain[0][6:8])  # completed by the 8th token of the first request
    assert stop.strip(), "the tiny tokenizer decoded nothing to stop at"
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop])
    want = llm.generate(prompts, params, use_tqdm=False)
    reference = {i: (len(p), out) for i, (p, out) in enumerate(zip(prompts, plain))}
    spec = {"method": "scripted", "num_speculative_tokens": 8, "script": scripted(reference, 8, [8])}
    got = make_llm(tiny, spec, device="cpu", block_size=4).generate(prompts, params, use_tqdm=False)
    assert [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in got] == \
           [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in want]
    assert want[0].outputs[0].finish_reason == "stop" and len(want[0].outputs[0].token_ids) <= 8


@pytest.mark.parametrize("max_tokens", [1, 4, 6])
def test_regression_speculation_runs_what_plain_decoding_runs(tiny: str, max_tokens: int) -> None:
    """A pool of one block: plain decoding runs a 10-token prompt for up to 6 tokens (16 positions);
    speculation must run it too (drafts shrink to fit) and give the same tokens, not refuse it."""
    prompt = make_prompts(1, seed=8)[0][:10]
    assert len(prompt) == 10
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    want = make_llm(tiny, None, device="cpu", num_kv_blocks=1).generate([prompt], params, use_tqdm=False)[0]
    assert want.error is None and len(want.outputs[0].token_ids) == max_tokens
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    got = make_llm(tiny, spec, device="cpu", num_kv_blocks=1).generate([prompt], params, use_tqdm=False)[0]
    assert got.error is None, got.error
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
