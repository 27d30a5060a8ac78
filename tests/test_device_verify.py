"""Verify steps built on the device (pyengine/engine/device_verify.py, hipkernels/spec/
next_verify_step.h): the reference against the host's own pieces (greedy acceptance, the ngram
lookup, graph staging), the engine on the CPU graph-runner path (outputs equal plain decoding's,
and the launched steps are used), and on a GPU the kernel against the reference."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pyengine import LLM, SamplingParams, _C
from pyengine.ops.reference.next_verify_step import (FIRST_POSITION, HISTORY_ROW, MAX_DRAFTS, PREDICTED,
                                                     PREV_DRAFTS, ROW_FIELDS, TOKENS_LEFT, next_verify_step,
                                                     row_width)
from tests.test_spec_decode import make_prompts
from tests.test_verify_ahead import K, graph_llm, looping_prompt, outputs, stopping_params
from tests.tiny_models import make_checkpoint

MAX_DRAFTS_CAP, BS, WIDTH, T, R = 6, 4, 16, 160, 16


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tiny_llama_device_verify"))
    make_checkpoint("llama_gqa_untied", path)
    return path


def random_step(seed: int, rows: int, q: int):
    """A verify step's host view and the kernel's inputs: each row's tokens so far (a small
    vocabulary, so the lookup finds matches), its drafts, an argmax that keeps some of them,
    block tables with holes past each row's blocks, a sync of part of each history, and for some
    rows a prediction of the step's outcome (right or wrong) with drafts after it."""
    rng = np.random.default_rng(seed)
    slots = rng.permutation(8)[:rows]
    history = torch.full((8, WIDTH * BS), -7, dtype=torch.int32)
    info = np.zeros((rows, row_width(MAX_DRAFTS_CAP)), dtype=np.int64)
    tokens, argmax, sync = [], [], []
    tables = np.full((R, WIDTH), -1, dtype=np.int32)
    start = 0
    for r in range(rows):
        n = int(rng.integers(2, 30))
        toks = rng.integers(0, 5, n).astype(np.int32)
        d = int(rng.integers(0, MAX_DRAFTS_CAP + 1))
        drafts = rng.integers(0, 5, d)
        am = rng.integers(0, 5, d + 1)
        keep = int(rng.integers(0, d + 1))
        am[:keep] = drafts[:keep]
        have = int(rng.integers(0, n + 1))  # the device already holds the first `have` tokens
        history[slots[r], :have] = torch.from_numpy(toks[:have])
        blocks = int(rng.integers((n + d + 1) // BS + 1, WIDTH + 1))
        tables[r, :blocks] = rng.permutation(200)[:blocks]
        info[r, :PREDICTED] = (start, d, n - 1, rng.integers(0, MAX_DRAFTS_CAP + 1), rng.integers(1, 12),
                                slots[r], have, n - have, sum(len(s) for s in sync))
        info[r, ROW_FIELDS:ROW_FIELDS + d] = drafts
        if rng.random() < 0.6:  # a prediction: all accepted, then a guess at the bonus token (right or wrong)
            n_pred = int(rng.integers(1, MAX_DRAFTS_CAP + 2))
            guess = am[d] if rng.random() < 0.7 else (am[d] + 1) % 5
            info[r, PREDICTED] = n_pred
            info[r, ROW_FIELDS + MAX_DRAFTS_CAP] = guess
            after = ROW_FIELDS + MAX_DRAFTS_CAP + 1  # the predicted drafts (tokens the lookup never finds)
            info[r, after:after + n_pred - 1] = rng.integers(5, 9, n_pred - 1)
        tokens.append(toks)
        argmax.append(am)
        sync.append(toks[have:])
        start += d + 1
    shape = dict(block_size=BS, max_context=WIDTH * BS, token_capacity=T, row_capacity=R, rows=rows,
                 padded_rows=2 * rows, q=q, token_slots=rows * q, max_drafts=MAX_DRAFTS_CAP, min_n=1, max_n=3)
    args = (torch.from_numpy(np.concatenate(argmax).astype(np.int64)), torch.from_numpy(info),
            torch.from_numpy(np.concatenate(sync + [np.zeros(1, np.int32)])), history, torch.from_numpy(tables))
    return tokens, args, shape


def fresh_outputs(rows: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's static inputs (filled with 99) and result buffers for `rows` rows."""
    return (torch.full((3 * T + 2 * R + 1,), 99, dtype=torch.int64, device=device),
            torch.zeros(rows, 3 + MAX_DRAFTS_CAP, dtype=torch.int64, device=device))


def run_reference(args, shape):
    inputs, result = fresh_outputs(shape["rows"])
    history = args[3].clone()
    next_verify_step(args[0], args[1], args[2], history, args[4], inputs, result, **shape)
    return inputs, result, history


@pytest.mark.parametrize("seed", range(12))
def test_the_reference_is_the_hosts_rule(seed: int) -> None:
    """Against the host's own pieces: acceptance and bonus as greedy_accept gives them, the
    history equal to the tokens then committed, the drafts the ngram lookup over them (capped by
    the row's length, tokens left and table), and the static inputs as stage_graph_step stages
    the step that launch_rows lays out."""
    rows = 1 + seed % 5
    q = 1 + MAX_DRAFTS_CAP
    tokens, args, shape = random_step(seed, rows, q)
    inputs, result, history = run_reference(args, shape)
    argmax, info, tables = args[0].numpy(), args[1].numpy(), args[4].numpy()
    d = info[:, PREV_DRAFTS]
    qsl = np.concatenate(([0], np.cumsum(d + 1))).astype(np.int32)
    ids = np.zeros(int(qsl[-1]), dtype=np.int64)
    for r in range(rows):
        ids[qsl[r] + 1:qsl[r + 1]] = info[r, ROW_FIELDS:ROW_FIELDS + d[r]]
    got, counts, bad = _C.greedy_accept(argmax, np.ones(len(argmax), bool), (d + 1).astype(np.int32),
                                        d.astype(np.int32), qsl, ids)
    assert bad is None
    res = result.numpy()
    assert np.array_equal(res[:, 0] + 1, counts)
    ends = np.cumsum(counts)
    for r in range(rows):
        committed = np.concatenate((tokens[r], got[ends[r] - counts[r]:ends[r]]))
        assert np.array_equal(history[info[r, HISTORY_ROW], :len(committed)].numpy(), committed)
        assert res[r, 2] == committed[-1]
        left = info[r, TOKENS_LEFT] - counts[r]
        limit = 0 if left < 2 else min(info[r, MAX_DRAFTS], q - 1, left - 1)
        first = len(committed) - 1
        while limit and tables[r, (first + limit) // BS] < 0:
            limit -= 1
        pred = info[r, ROW_FIELDS + MAX_DRAFTS_CAP:ROW_FIELDS + MAX_DRAFTS_CAP + info[r, PREDICTED]]
        if counts[r] == d[r] + 1 and len(pred) > 1 and pred[0] == committed[-1] and limit:
            want = list(pred[1:1 + limit])  # the prediction held: its drafts (tokens 5-8, never looked up)
        else:
            want = _C.propose_ngram(committed, 1, 3, limit) if limit else []
        assert res[r, 1] == len(want) and list(res[r, 3:3 + len(want)]) == list(want)
    assert np.array_equal(inputs.numpy(), host_staging(info, tables, res, q))


def host_staging(info: np.ndarray, tables: np.ndarray, res: np.ndarray, q: int) -> np.ndarray:
    """The static inputs of the step the results describe, as the host stages it (launch_rows,
    stage_graph_step)."""
    rows = len(res)
    first = info[:rows, FIRST_POSITION] + 1 + res[:, 0]
    step = _C.launch_rows(first, (1 + res[:, 1]).astype(np.int32), tables[:rows], BS, WIDTH * BS)
    assert step is not None
    sq, pos, slot_mapping, ctx, _ = step
    next_ids = np.concatenate([res[r, 2:3 + res[r, 1]] for r in range(rows)])
    h64 = np.full(3 * T + 2 * R + 1, 99, dtype=np.int64)
    _C.stage_graph_step(h64, np.zeros((R, WIDTH), np.int32), T, R, 2 * rows, q, rows * q, sq.astype(np.int32),
                        next_ids, pos, slot_mapping, ctx, tables[:rows])
    return h64


@pytest.mark.parametrize("method", ["ngram", "suffix"])
@pytest.mark.parametrize("adaptive", [False, True])
@pytest.mark.parametrize("block_size", [16, 2])
def test_device_verify_equals_plain(tiny: str, method: str, adaptive: bool, block_size: int) -> None:
    """A looping continuation: nearly every verify step is built by the step before it and used,
    none through verify ahead's predictions; tokens equal plain decoding's."""
    prompts = [looping_prompt()]
    params = SamplingParams(temperature=0, max_tokens=150, ignore_eos=True)
    plain = outputs(LLM(model=tiny, device="cpu", block_size=block_size), prompts, params)
    spec = {"method": method, "num_speculative_tokens": K, "adaptive_draft_length": adaptive,
            "prompt_lookup_min": 1, "prompt_lookup_max": 3, "step_cost": (1.0, 0.01)}
    llm = graph_llm(tiny, spec, device_verify=True, block_size=block_size)
    assert outputs(llm, prompts, params) == plain
    loop, steps = llm.engine.device_verify, llm.stats()["num_steps"]
    assert loop.num_used >= steps // 2 and loop.num_used <= loop.num_launched, (loop.num_used, steps)
    assert llm.engine.verify_ahead.num_launched == 0 and llm.stats()["num_accepted_tokens"] > 50


@pytest.mark.parametrize("method,rows,block_size,blocks,max_rows", [
    ("ngram", 4, 4, 22, 4), ("ngram", 3, 2, 46, 4), ("suffix", 4, 4, 22, 4), ("suffix", 4, 4, 22, 2)])
def test_device_verify_batches_stops_and_preemption(tiny: str, method: str, rows: int, block_size: int,
                                                    blocks: int, max_rows: int) -> None:
    """Rows of ragged lengths, stop ids and strings ending rows mid-chain, a small KV pool that
    preempts, more requests than rows (admissions between chains): plain decoding's outputs.
    Suffix with max_rows 2: steps of 3-4 rows go the host's ways, smaller ones the
    device's, and a request passes from one to the other (its history resynced)."""
    prompts = make_prompts(10, seed=5) + [looping_prompt()] * 2
    free = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    base = outputs(LLM(model=tiny, device="cpu", block_size=block_size), prompts, free)
    params = stopping_params(base, 48, stop_at=17, word_at=15)
    plain = outputs(LLM(model=tiny, device="cpu", block_size=block_size), prompts, params)
    spec = {"method": method, "num_speculative_tokens": K, "adaptive_draft_length": False,
            "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    llm = graph_llm(tiny, spec, device_verify=True, block_size=block_size, max_num_seqs=rows,
                    num_kv_blocks=blocks, max_model_len=128)
    llm.engine.device_verify.max_rows = max_rows
    assert outputs(llm, prompts, params) == plain
    assert any(p[1] == "stop" for p in plain)
    assert llm.stats()["num_preemptions"] > 0
    assert llm.engine.device_verify.num_used > 0
    if max_rows < rows:  # the larger steps went the host's ways
        va = llm.engine.verify_ahead
        assert va.num_launched + va.num_committed_launches > 0


@pytest.mark.parametrize("seed", [1, 2])
def test_steps_without_drafts_stay_launched_ahead(tiny: str, seed: int) -> None:
    """Prompts the lookup finds little in (the policy keeps planning drafts that are rarely found):
    a built step whose rows found none is a decode batch on a verify graph, and the step after it
    is still launched ahead (on the decode graph, or built again) - nearly every step is."""
    prompts = make_prompts(2, seed=seed)
    params = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)
    plain = outputs(LLM(model=tiny, device="cpu"), prompts, params)
    # from two matched tokens: on these prompts the lookup then finds few drafts (the premise)
    spec = {"method": "ngram", "num_speculative_tokens": K, "step_cost": (1.0, 0.01), "prompt_lookup_min": 2}
    llm = graph_llm(tiny, spec, device_verify=True, max_num_seqs=2)
    assert outputs(llm, prompts, params) == plain
    eng, steps = llm.engine, llm.stats()["num_steps"]
    assert eng.device_verify.num_used >= steps // 2
    assert eng.num_async_steps >= steps - 5 and eng.num_async_discarded == 0, (eng.num_async_steps, steps)
    # none had to wait for its predecessor's commit (VerifyAhead.launch_committed)
    assert eng.verify_ahead.num_committed_launches <= 2, eng.verify_ahead.num_committed_launches


def test_an_abort_discards_the_device_step(tiny: str) -> None:
    """A request aborted while a step built for it is pending: the step is discarded and the
    others' tokens stay plain decoding's."""
    prompts = [looping_prompt(), make_prompts(1, seed=9)[0], looping_prompt()[::-1]]
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    plain = outputs(LLM(model=tiny, device="cpu"), prompts, params)
    spec = {"method": "ngram", "num_speculative_tokens": K, "adaptive_draft_length": False,
            "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    eng = graph_llm(tiny, spec, device_verify=True, max_num_seqs=3).engine
    reqs = [eng.add_request(p, params) for p in prompts]
    aborted = False
    while eng.has_unfinished():
        eng.step()
        if not aborted and eng._pending is not None and eng._pending.from_device:
            assert eng.abort_request(reqs[1].request_id)
            aborted = True
    assert aborted and eng.num_async_discarded > 0
    assert reqs[1].finish_reason == "abort"
    for i in (0, 2):
        assert reqs[i].output_token_ids == plain[i][0]


def test_which_engines_have_the_loop(tiny: str) -> None:
    """ngram (lookup only) and suffix (its predictions first) on graphs; not when turned off, not
    without graphs, not for the model-based methods (their drafts are another loop's)."""
    from pyengine.engine.device_verify import DeviceVerifyLoop
    from pyengine.spec_decode.config import SpeculativeConfig

    suffix = graph_llm(tiny, {"method": "suffix", "num_speculative_tokens": K}, device_verify=True).engine
    assert suffix.device_verify is not None and suffix.device_verify.predictor is suffix.proposer
    spec = {"method": "ngram", "num_speculative_tokens": K}
    ngram = graph_llm(tiny, spec, device_verify=True).engine
    assert ngram.device_verify is not None and ngram.device_verify.predictor is None
    assert graph_llm(tiny, spec, device_verify=False).engine.device_verify is None
    assert LLM(model=tiny, device="cpu", speculative_config=spec).engine.device_verify is None  # no graphs
    mtp = SpeculativeConfig.from_dict({"method": "mtp", "num_speculative_tokens": 2})
    assert DeviceVerifyLoop.for_engine(ngram.runner.graph_runner, 4, mtp, None) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("seed", range(8))
def test_the_kernel_is_the_reference(seed: int) -> None:
    """hipkernels/spec/next_verify_step on the device: the same history, result and static
    inputs as the reference, bit for bit (integers)."""
    pytest.importorskip("pyengine.ops.cuda.next_verify_step")
    from pyengine.ops.cuda.next_verify_step import next_verify_step as kernel

    rows = 1 + seed % 8
    q = 1 + (seed % MAX_DRAFTS_CAP) + (seed % 2)
    q = min(q, 1 + MAX_DRAFTS_CAP)
    _, args, shape = random_step(seed, rows, q)
    want = run_reference(args, shape)
    cuda = [t.cuda() for t in args]
    inputs, result = fresh_outputs(rows, "cuda")
    kernel(cuda[0], cuda[1], cuda[2], cuda[3], cuda[4], inputs, result, **shape)
    torch.cuda.synchronize()
    assert torch.equal(inputs.cpu(), want[0])
    n = 3 + int(want[1][:, 1].max())
    assert torch.equal(result.cpu()[:, :n], want[1][:, :n])
    assert torch.equal(cuda[3].cpu(), want[2])
