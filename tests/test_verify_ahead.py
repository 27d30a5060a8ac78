"""Verify ahead (pyengine/engine/verify_ahead.py): a greedy verify step launches the next verify
step, its tokens and drafts predicted as if every row accepts all its drafts. Run on the CPU
through the graph runner's padded path (there the "launch" computes at once), so the prediction,
the confirmation, the match and every discard path run: outputs must equal plain decoding's, token
for token and finish reason for finish reason, with ngram and suffix, fixed and adaptive lengths,
1-3 rows, block sizes 2 / 16 (launched steps that cross blocks), stop ids and strings, ragged
max_tokens, and preemption."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pyengine import LLM, SamplingParams
from pyengine.engine.cuda_graph_runner import CudaGraphRunner
from pyengine.engine.llm_engine import LLMEngine
from tests.test_spec_decode import make_prompts
from tests.tiny_models import make_checkpoint

K = 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tiny_llama_verify_ahead"))
    make_checkpoint("llama_gqa_untied", path)
    return path


def graph_llm(tiny: str, spec: dict | None, device_verify: bool = False, **kw) -> LLM:
    """An LLM whose runner has the graph runner's padded path (q up to K + 1), its engine made
    after it as on a GPU: the scheduler then reserves the next step's blocks. device_verify: ngram
    verify steps built by the device loop (tests/test_device_verify.py; off here, so that ngram
    steps are predicted by verify ahead)."""
    llm = LLM(model=tiny, device="cpu", speculative_config=spec, **kw)
    e = llm.engine
    r = e.runner
    r.graph_runner = CudaGraphRunner(r.model, r.kv_caches, r.block_size, r.device, e.cfg.max_num_seqs, K + 1,
                                     e.cfg.max_model_len + K + 1 + r.block_size)
    e.cfg.device_verify = device_verify
    llm.engine = LLMEngine(r, e.model_config, e.tokenizer, e.cfg, draft_model=e.draft_model)
    return llm


def outputs(llm: LLM, prompts, params) -> list[tuple]:
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].text, o.error) for o in outs]


def stopping_params(base: list[tuple], max_tokens: int, stop_at: int, word_at: int) -> list[SamplingParams]:
    """Greedy params per request (base: its outputs run free, as outputs() gives them): every third
    stops at its stop_at-th token's id, the next at its word_at-th word (a stop string), the third
    ignores EOS with a ragged max_tokens (20, 25, ... by position)."""
    params = []
    for i, (toks, _, text, _) in enumerate(base):
        if i % 3 == 0:
            params.append(SamplingParams(temperature=0, max_tokens=max_tokens, stop_token_ids=[toks[stop_at]]))
        elif i % 3 == 1:
            words = text.split()
            params.append(SamplingParams(temperature=0, max_tokens=max_tokens,
                                         stop=[words[min(word_at, len(words) - 1)]]))
        else:
            params.append(SamplingParams(temperature=0, max_tokens=20 + 5 * (i % 10), ignore_eos=True))
    return params


def looping_prompt() -> list[int]:
    # the tiny random model falls into a short loop on this one, so the proposers predict well
    return make_prompts(2, seed=5)[0]


@pytest.mark.parametrize("method", ["suffix", "ngram"])
@pytest.mark.parametrize("adaptive", [False, True])
@pytest.mark.parametrize("block_size", [16, 2])
def test_verify_ahead_equals_plain(tiny: str, method: str, adaptive: bool, block_size: int) -> None:
    """The real proposers' predictions on a looping continuation: nearly every verify step is
    launched by the one before, and the tokens are plain decoding's."""
    prompts = [looping_prompt()]
    params = SamplingParams(temperature=0, max_tokens=150, ignore_eos=True)
    plain = outputs(LLM(model=tiny, device="cpu", block_size=block_size), prompts, params)
    spec = {"method": method, "num_speculative_tokens": K, "adaptive_draft_length": adaptive,
            "prompt_lookup_min": 1, "prompt_lookup_max": 3, "step_cost": (1.0, 0.01)}
    llm = graph_llm(tiny, spec, block_size=block_size)
    assert outputs(llm, prompts, params) == plain
    va = llm.engine.verify_ahead
    assert va.num_used >= 10, (va.num_launched, va.num_confirmed, va.num_used)
    assert llm.engine.num_async_steps >= va.num_used


def oracle(prompts, answers, wrong_every: int, gap: int = 0):
    """A script drafting each request's plain continuation, wrong at every wrong_every-th position
    (and with gap: nothing at every gap-th position)."""
    def script(seq_id: int, tokens: list[int]) -> list[int]:
        for prompt, answer in zip(prompts, answers):
            n = len(tokens) - len(prompt)
            if gap and n % gap == gap - 1:
                continue
            if tokens[:len(prompt)] == list(prompt) and 0 <= n < len(answer):
                return [(t + 1) % 96 if (n + j) % wrong_every == wrong_every - 1 else t
                        for j, t in enumerate(answer[n:n + K + 1])]
        return []
    return script


def oracle_llm(tiny: str, prompts, params, wrong_every: int, adaptive: bool = False,
               block_size: int = 16) -> tuple[LLM, list]:
    """Plain decoding's outputs, and an LLM on the graph path with one row per prompt whose
    proposer drafts them (oracle)."""
    from tests.scripted_proposer import ScriptedProposer

    plain = outputs(LLM(model=tiny, device="cpu", block_size=block_size), prompts, params)
    spec = {"method": "ngram", "num_speculative_tokens": K, "adaptive_draft_length": adaptive,
            "step_cost": (1.0, 0.01)}
    llm = graph_llm(tiny, spec, block_size=block_size, max_num_seqs=len(prompts))
    llm.engine.proposer = ScriptedProposer(oracle(prompts, [p[0] for p in plain], wrong_every))
    return llm, plain


@pytest.mark.parametrize("rows,block_size", [(1, 16), (3, 2), (3, 16)])
@pytest.mark.parametrize("adaptive", [False, True])
def test_verify_ahead_with_an_oracle(tiny: str, rows: int, block_size: int, adaptive: bool) -> None:
    """Drafts and predictions from the plain continuation, wrong at every 9th position: launched
    steps are used where every row's prediction held and discarded elsewhere; 3 rows of ragged
    lengths; tokens equal plain decoding's."""
    prompts = make_prompts(rows, seed=rows)
    params = [SamplingParams(temperature=0, max_tokens=30 + 9 * i, ignore_eos=True) for i in range(rows)]
    llm, plain = oracle_llm(tiny, prompts, params, 9, adaptive, block_size)
    assert outputs(llm, prompts, params) == plain
    va = llm.engine.verify_ahead
    assert va.num_used > 0 and va.num_launched > va.num_confirmed, (va.num_launched, va.num_confirmed, va.num_used)


def test_verify_ahead_stops_and_preemption(tiny: str) -> None:
    """Stop ids and strings end rows at steps a prediction does not know of; a small KV pool
    preempts rows (the blocks reserved ahead are optional: they never preempt anyone)."""
    prompts = make_prompts(10, seed=5)
    free = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    base = outputs(LLM(model=tiny, device="cpu", block_size=4), prompts, free)
    params = stopping_params(base, 40, stop_at=11, word_at=13)
    plain = outputs(LLM(model=tiny, device="cpu", block_size=4), prompts, params)
    spec = {"method": "ngram", "num_speculative_tokens": K, "adaptive_draft_length": False}
    llm = graph_llm(tiny, spec, block_size=4, max_num_seqs=4, num_kv_blocks=22, max_model_len=128)
    from tests.scripted_proposer import ScriptedProposer
    llm.engine.proposer = ScriptedProposer(oracle(prompts, [p[0] for p in base], 11))
    assert outputs(llm, prompts, params) == plain
    assert any(p[1] == "stop" for p in plain)
    assert llm.stats()["num_preemptions"] > 0
    assert llm.engine.verify_ahead.num_confirmed > 0


def test_a_wrong_prediction_is_never_used(tiny: str) -> None:
    """Predictions whose token after the drafts is always wrong: every launched step is discarded
    (none confirmed), the outputs stay plain decoding's, and the launches stop below the hit rate
    but for the probes."""
    prompts = [looping_prompt()]
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    plain = outputs(LLM(model=tiny, device="cpu"), prompts, params)
    llm = graph_llm(tiny, {"method": "suffix", "num_speculative_tokens": K, "adaptive_draft_length": False})
    va, proposer = llm.engine.verify_ahead, llm.engine.proposer
    predict = proposer.predict

    def wrong(*args):
        tokens, counts = predict(*args)
        tokens = tokens.copy()
        tokens[:, 0] = (tokens[:, 0] + 1) % 96
        return tokens, counts

    proposer.predict = wrong
    assert outputs(llm, prompts, params) == plain
    assert va.num_launched > 0 and va.num_confirmed == 0
    steps = llm.stats()["num_steps"]
    assert va.num_launched <= 4 + steps // va.PROBE_EVERY, (va.num_launched, steps)


def test_predict_continues_past_the_drafts(tiny: str) -> None:
    """Scheduler.predict_suffix / predict_ngram: the chain after the tokens and the drafts in
    flight, its first token the one after the drafts."""
    from pyengine import _C

    sc = _C.SchedulerConfig()
    sc.num_spec_tokens, sc.max_model_len, sc.block_size, sc.num_kv_blocks = 4, 64, 4, 16
    sc.max_num_seqs, sc.max_num_batched_tokens = 2, 64
    s = _C.Scheduler(sc)
    tokens = [5, 6, 7, 8, 9, 10, 11, 5, 6]
    s.add_request(0, tokens, 30)
    s.schedule()
    s.update(np.array([7], dtype=np.int32), np.array([1], dtype=np.int32))  # ... 5 6 7 committed
    ids, drafts, counts = np.array([0]), np.array([8, 9], dtype=np.int32), np.array([2], dtype=np.int32)
    suffix = _C.SuffixProposer()
    for got in (s.predict_suffix(suffix, ids, drafts, counts, np.array([2], dtype=np.int32)),
                s.predict_ngram(1, 3, ids, drafts, counts, np.array([2], dtype=np.int32))):
        pred, n = got
        assert n.tolist() == [3] and pred[0, :3].tolist() == [10, 11, 5]
    # lengths cap the drafts after the predicted token
    pred, n = s.predict_ngram(1, 3, ids, drafts, counts, np.array([0], dtype=np.int32))
    assert n.tolist() == [1] and pred[0, 0] == 10


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("method", ["suffix", "ngram"])
def test_verify_ahead_gpu_smollm2(method: str) -> None:
    """On CUDA graphs with SmolLM2 (bf16): verify steps launched ahead (ngram: built on the device)
    and used, tokens identical to plain decoding's at batch 1 and 4."""
    import os

    from pyengine.loader import default_model_path

    path = os.environ.get("PYENGINE_SMOLLM2_GGUF")
    if not path:
        try:
            path = default_model_path()
        except ValueError as exc:
            pytest.skip(str(exc))
    texts = ["Repeat after me three times: the quick brown fox jumps over the lazy dog.",
             "Copy this list exactly: apples, pears, plums, cherries, grapes, lemons, limes.",
             "Write a short poem about the sea.", "Count from one to twenty in words."]
    params = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)
    plain = LLM(model=path, device="cuda", num_kv_blocks=1024)
    convs = [[{"role": "user", "content": t}] for t in texts]
    ref = [o.outputs[0].token_ids for o in plain.chat(convs, params, use_tqdm=False)]
    del plain
    for batch in (1, 4):
        llm = LLM(model=path, device="cuda", num_kv_blocks=1024, max_num_seqs=batch,
                  speculative_config={"method": method, "num_speculative_tokens": K})
        got = [o.outputs[0].token_ids for o in llm.chat(convs, params, use_tqdm=False)]
        assert got == ref
        # built on the device (device_verify.py) in steps of at most its max_rows rows, else
        # predicted (verify ahead)
        loop = llm.engine.device_verify
        assert loop is not None
        ahead = loop if batch <= loop.max_rows else llm.engine.verify_ahead
        print(f"{method} batch {batch}: launched {ahead.num_launched}, used {ahead.num_used}")
        if batch == 1:
            assert ahead.num_used > 0
        del llm
        torch.cuda.empty_cache()


@pytest.mark.parametrize("rows", [1, 3])
def test_verify_ahead_from_a_decode_step(tiny: str, rows: int) -> None:
    """A decode step whose next step is planned to draft (the policy drafts every 3rd step here)
    launches that verify step ahead, its token and drafts predicted (_plan_next's lengths)."""
    from tests.scripted_proposer import ScriptedProposer
    from tests.test_async_decode import EveryNthStep

    prompts = make_prompts(rows, seed=rows + 1)
    params = [SamplingParams(temperature=0, max_tokens=40 + 9 * i, ignore_eos=True) for i in range(rows)]
    plain = outputs(LLM(model=tiny, device="cpu"), prompts, params)
    llm = graph_llm(tiny, {"method": "ngram", "num_speculative_tokens": K}, max_num_seqs=rows)
    eng = llm.engine
    eng.proposer = ScriptedProposer(oracle(prompts, [p[0] for p in plain], 13))
    eng.draft_length = EveryNthStep(K, 3)
    va, launch = eng.verify_ahead, eng.verify_ahead.launch
    from_decode = []

    def counted(scheduler, proposer, graph_runner, batch, lengths):
        pending = launch(scheduler, proposer, graph_runner, batch, lengths)
        if not batch.num_draft_tokens.any():
            from_decode.append(pending is not None)
        return pending

    va.launch = counted
    assert outputs(llm, prompts, params) == plain
    assert sum(from_decode) >= 2 and va.num_used >= 3, (from_decode, va.num_used)


def test_unpredictable_rows_stop_the_predictions(tiny: str) -> None:
    """A proposer that predicts nothing for one row of three: no step is launched, and after a few
    tries the predictions are asked for only once in PROBE_EVERY chances (their host cost)."""
    prompts = make_prompts(3, seed=4)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    llm, plain = oracle_llm(tiny, prompts, params, 7)
    eng = llm.engine
    proposer, va = eng.proposer, eng.verify_ahead
    predict, launch, calls = proposer.predict, va.launch, []

    def one_row_unknown(scheduler, seq_ids, *rest):
        tokens, counts = predict(scheduler, seq_ids, *rest)
        counts = counts.copy()
        counts[-1] = 0
        return tokens, counts

    def counted(*args):  # a prediction asked for (launch_committed's drafts are not predictions)
        calls.append(1)
        return launch(*args)

    proposer.predict, va.launch = one_row_unknown, counted
    assert outputs(llm, prompts, params) == plain
    assert va.num_launched == 0
    verify_steps = eng.scheduler.stats()["num_verify_rows"] // 3
    assert 2 <= len(calls) <= 3 + verify_steps // va.PROBE_EVERY, (len(calls), verify_steps)


def test_the_policy_chance_gates_predictions(tiny: str) -> None:
    """With the draft-length policy a prediction is made only where its acceptance estimates give it
    at least MIN_CHANCE: above any chance, none is launched; at 0, as before."""
    prompts = [looping_prompt()]
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    spec = {"method": "suffix", "num_speculative_tokens": K, "step_cost": (1.0, 0.01)}
    launched = []
    for min_chance in (1.01, 0.0):
        llm = graph_llm(tiny, spec)
        llm.engine.verify_ahead.MIN_CHANCE = min_chance
        outputs(llm, prompts, params)
        launched.append(llm.engine.verify_ahead.num_launched)
    assert launched[0] == 0 and launched[1] >= 10, launched


def test_an_abort_between_steps_discards_the_launched_step(tiny: str) -> None:
    """A request aborted while a verify step launched for it is pending (a client that went away):
    the launched step is discarded, the others' tokens stay plain decoding's, and the aborted
    request's blocks are free at once."""
    prompts = make_prompts(3, seed=6)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    llm, plain = oracle_llm(tiny, prompts, params, 1000)
    eng = llm.engine
    reqs = [eng.add_request(p, params) for p in prompts]
    aborted = False
    while eng.has_unfinished():
        eng.step()
        if not aborted and eng._pending is not None and eng._pending.expected is not None:
            free = eng.scheduler.num_free_blocks
            assert eng.abort_request(reqs[1].request_id)
            aborted = True
            assert eng.scheduler.num_free_blocks > free
    assert aborted and eng.num_async_discarded > 0
    assert reqs[1].finish_reason == "abort"
    for i in (0, 2):
        assert reqs[i].output_token_ids == plain[i][0]


def test_async_decode_off_turns_verify_ahead_off(tiny: str) -> None:
    prompts = [looping_prompt()]
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    spec = {"method": "suffix", "num_speculative_tokens": K, "adaptive_draft_length": False}
    llm = graph_llm(tiny, spec, async_decode=False)
    assert llm.engine.verify_ahead is None
    assert outputs(llm, prompts, params) == outputs(LLM(model=tiny, device="cpu"), prompts, params)
    assert llm.engine.num_async_steps == 0 and llm.stats()["num_accepted_tokens"] > 0


@pytest.mark.parametrize("rows,block_size", [(1, 16), (3, 2)])
@pytest.mark.parametrize("adaptive", [False, True])
def test_steps_launched_from_committed_tokens(tiny: str, rows: int, block_size: int, adaptive: bool) -> None:
    """With no predictions (VerifyAhead.launch off), each greedy step launches the next one from
    the tokens it committed and the proposer's drafts over them (launch_committed): nearly all
    are used (the next batch is the launched one), every row's accept count varies (the oracle is
    wrong at every 7th position), 3 rows of ragged lengths end at different steps; tokens equal
    plain decoding's."""
    prompts = make_prompts(rows, seed=rows + 10)
    params = [SamplingParams(temperature=0, max_tokens=30 + 9 * i, ignore_eos=True) for i in range(rows)]
    llm, plain = oracle_llm(tiny, prompts, params, 7, adaptive, block_size)
    eng = llm.engine
    va = eng.verify_ahead
    va.launch = lambda *args: None
    assert outputs(llm, prompts, params) == plain
    verify_steps = eng.scheduler.stats()["num_verify_rows"] // rows
    assert va.num_launched == 0 and va.num_committed_launches >= verify_steps // 2, \
        (va.num_committed_launches, verify_steps)
    assert eng.num_async_steps >= 0.8 * va.num_committed_launches, (eng.num_async_steps, va.num_committed_launches)
    # without them, far fewer steps run launched ahead (decode steps' launch_next only)
    llm2, _ = oracle_llm(tiny, prompts, params, 7, adaptive, block_size)
    llm2.engine.verify_ahead.launch = lambda *args: None
    llm2.engine._launch_committed = lambda *args: None
    assert outputs(llm2, prompts, params) == plain
    assert llm2.engine.num_async_steps < eng.num_async_steps - verify_steps // 2
