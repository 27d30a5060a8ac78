"""Verify steps built on the device for drafting layers (pyengine/spec_decode/layer_device_drafts.py:
EAGLE-3, MTP): next_verify_step's two halves against its whole (the reference, and on a GPU the
kernel against the reference), and the engine on the CPU graph-runner path, where every step's
drafts must equal the host path's (the layer's catch-up over the step's argmax and its chain
shifted on the device compute the entries the host's catch-up computes) and outputs plain
decoding's, with rows ending mid-chain, preemption, admissions, deferred catch-ups (the draft-length
policy) and launched steps discarded."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pyengine import LLM, SamplingParams
from pyengine.engine.host_arrays import draft_token_ids
from pyengine.ops.reference.next_verify_step import (ACCEPT, FIRST_POSITION, LAYER_DRAFTS, MAX_DRAFTS, PREDICTED,
                                                     TOKENS_LEFT, next_verify_step)
from tests.test_device_verify import BS, MAX_DRAFTS_CAP, R, fresh_outputs, host_staging, random_step
from tests.test_eagle3 import head, target  # noqa: F401  (module fixtures: the tiny target and its trained head)
from tests.test_verify_ahead import graph_llm, outputs, stopping_params
from tests.tiny_models import make_deepseek_checkpoint, make_prompts


def _phases(args, shape, drafts: torch.Tensor, kernel=next_verify_step):
    """The two halves on fresh outputs: (inputs, result after ACCEPT, result, history)."""
    inputs, result = fresh_outputs(shape["rows"], args[0].device)
    history = args[3].clone()
    kernel(args[0], args[1], args[2], history, args[4], inputs, result, **shape, phase=ACCEPT)
    accepted = result.clone()
    kernel(args[0], args[1], args[2], history, args[4], inputs, result, **shape, phase=LAYER_DRAFTS,
           layer_drafts=drafts)
    return inputs, accepted, result, history


@pytest.mark.parametrize("seed", range(10))
def test_the_halves_are_the_whole_with_the_layers_drafts(seed: int) -> None:
    """ACCEPT: the whole step's acceptance, bonus and history, and in place of drafts each row's
    limit (the most the whole step would take: its max drafts, q - 1, tokens left, blocks);
    LAYER_DRAFTS: each row's first `limit` drafts of the layer's [draft, row] buffer, staged as
    the host stages that step (launch_rows, stage_graph_step)."""
    rows = 1 + seed % 5
    q = 1 + MAX_DRAFTS_CAP - seed % 3
    _, args, shape = random_step(seed, rows, q)
    shape = dict(shape, min_n=0, max_n=0)
    args[1][:, PREDICTED] = 0  # the whole step then drafts nothing
    whole_inputs, whole = fresh_outputs(rows)
    whole_history = args[3].clone()
    next_verify_step(args[0], args[1], args[2], whole_history, args[4], whole_inputs, whole, **shape)
    assert (whole[:, 1] == 0).all()
    drafts = torch.from_numpy(np.random.default_rng(seed).integers(100, 200, (MAX_DRAFTS_CAP, R)))
    inputs, accepted, result, history = _phases(args, shape, drafts)
    assert torch.equal(history, whole_history)
    assert torch.equal(accepted[:, 0], whole[:, 0]) and torch.equal(accepted[:, 2], whole[:, 2])
    info, tables = args[1].numpy(), args[4].numpy()
    res = result.numpy()
    for r in range(rows):
        a = res[r, 0]
        left = info[r, TOKENS_LEFT] - a - 1
        limit = 0 if left < 2 else min(info[r, MAX_DRAFTS], q - 1, left - 1)
        first = info[r, FIRST_POSITION] + 1 + a
        while limit and tables[r, (first + limit) // BS] < 0:
            limit -= 1
        assert accepted[r, 1] == limit == res[r, 1]
        assert list(res[r, 3:3 + limit]) == list(drafts[:limit, r].numpy())
    assert np.array_equal(inputs.numpy(), host_staging(info, tables, res, q))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("seed", range(6))
def test_the_kernels_halves_are_the_reference(seed: int) -> None:
    """hipkernels/spec/next_verify_step's ACCEPT and LAYER_DRAFTS phases on the device: the
    reference's history, results and static inputs, bit for bit."""
    pytest.importorskip("pyengine.ops.cuda.next_verify_step")
    from pyengine.ops.cuda.next_verify_step import next_verify_step as kernel

    rows = 1 + seed % 8
    _, args, shape = random_step(seed, rows, 1 + MAX_DRAFTS_CAP)
    shape = dict(shape, min_n=0, max_n=0)
    drafts = torch.from_numpy(np.random.default_rng(seed).integers(100, 200, (MAX_DRAFTS_CAP, R)))
    want = _phases(args, shape, drafts)
    got = _phases([t.cuda() for t in args], shape, drafts.cuda(), kernel=kernel)
    torch.cuda.synchronize()
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[3].cpu(), want[3])
    n = 3 + int(want[2][:, 1].max())
    assert torch.equal(got[1].cpu()[:, :3], want[1][:, :3]) and torch.equal(got[2].cpu()[:, :n], want[2][:, :n])


def _recorded_run(target: str, spec: dict, loop: bool, prompts, params, spy_held: list | None = None,
                  policy=None, **kw):
    """Outputs, every step's (rows, drafts per row, drafts) and the engine; spy_held: receives the
    number of positions each MtpProposer.catch_up_held call catches up; policy(engine): the
    engine's draft-length policy instead of its own."""
    llm = graph_llm(target, spec, device_verify=loop, **kw)
    eng = llm.engine
    if policy is not None:
        eng.draft_length = policy(eng)
    if spy_held is not None:
        p = eng.proposer
        catch_up = p.catch_up_held

        def spy(scheduler, seq_ids, first):
            valid = p.valid.get(seq_ids)
            spy_held.append(int(np.maximum(first - np.maximum(p.ring.held_from(seq_ids, first), valid), 0).sum()))
            return catch_up(scheduler, seq_ids, first)
        p.catch_up_held = spy
    steps = []
    commit = eng._commit

    def record(batch, *args):
        steps.append((tuple(batch.seq_ids.tolist()), tuple(batch.num_draft_tokens.tolist()),
                      tuple(draft_token_ids(batch).tolist())))
        return commit(batch, *args)
    eng._commit = record
    return outputs(llm, prompts, params), steps, eng


def _eagle3(head: str, k: int, adaptive: bool = False) -> dict:
    return {"method": "eagle3", "model": head, "num_speculative_tokens": k, "adaptive_draft_length": adaptive,
            "step_cost": (1.0, 0.01)}


@pytest.mark.parametrize("batch,k,block_size", [(1, 1, 16), (1, 3, 2), (3, 3, 16), (3, 4, 2)])
def test_eagle3_loop_drafts_as_the_host(target: str, head: str, batch: int, k: int, block_size: int) -> None:
    """Every step's drafts equal the host path's (the same steps in the same order), outputs
    plain decoding's; many verify steps are built on the device and used (at block size 2 the
    longest outcome of the next step often lacks a block: that step goes the host's way)."""
    prompts = make_prompts(batch, seed=3)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = outputs(LLM(model=target, device="cpu", block_size=block_size), prompts, params)
    host_out, host_steps, _ = _recorded_run(target, _eagle3(head, k), False, prompts, params, block_size=block_size)
    out, steps, eng = _recorded_run(target, _eagle3(head, k), True, prompts, params, block_size=block_size)
    assert host_out == plain and out == plain
    assert steps == host_steps
    loop = eng.device_verify
    assert loop is not None and loop.layer is not None
    verify_steps = sum(1 for _, d, _ in steps if any(d))
    assert loop.num_used >= (verify_steps - 2 * batch if block_size == 16 else 1), (loop.num_used, verify_steps)
    assert eng.stats()["num_accepted_tokens"] > 0


class PausingPolicy:
    """A draft-length policy for tests: every row drafts k except while its output length is a
    multiple of 3 (no drafts: its catch-up is deferred, HiddenRing), decided from the rows alone."""

    def __init__(self, engine, k: int) -> None:
        self.engine, self.k, self.last = engine, k, np.zeros(0, np.int32)

    def draft_lengths(self, slots, seq_ids, last) -> np.ndarray:
        reqs = self.engine.requests
        self.last = np.array([0 if len(reqs[s].output_token_ids) % 3 == 0 else self.k for s in seq_ids.tolist()],
                             dtype=np.int32)
        return self.last

    def expects_no_drafts(self) -> bool:
        return not self.last.any()

    def observe_rows(self, *args) -> None:
        pass


@pytest.mark.parametrize("rows,block_size,blocks,pausing", [(3, 4, 20, False), (2, 2, 37, False), (3, 4, 24, True)])
def test_eagle3_loop_stops_preemption_and_deferrals(target: str, head: str, rows: int, block_size: int, blocks: int,
                                                    pausing: bool) -> None:
    """Stop ids and strings ending rows mid-chain, a small KV pool that preempts, more requests
    than rows: plain decoding's outputs, and with fixed k the loop's drafts are the host's step for
    step. With a policy that pauses rows (PausingPolicy), the rows defer their catch-ups, which the
    loop catches up before it builds a step (catch_up_held); the loop's steps draft as the step
    before planned, the host's as the policy plans again, so only the outputs are compared."""
    prompts = make_prompts(8, seed=6)
    free = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    base = outputs(LLM(model=target, device="cpu", block_size=block_size), prompts, free)
    params = stopping_params(base, 40, stop_at=13, word_at=9)
    plain = outputs(LLM(model=target, device="cpu", block_size=block_size), prompts, params)
    kw = dict(block_size=block_size, max_num_seqs=rows, num_kv_blocks=blocks, max_model_len=128)
    policy = (lambda eng: PausingPolicy(eng, 3)) if pausing else None
    host_out, host_steps, _ = _recorded_run(target, _eagle3(head, 3), False, prompts, params, policy=policy, **kw)
    held: list[int] = []
    out, steps, eng = _recorded_run(target, _eagle3(head, 3), True, prompts, params, spy_held=held, policy=policy, **kw)
    assert host_out == plain and out == plain
    assert any(p[1] == "stop" for p in plain)
    assert eng.stats()["num_preemptions"] > 0
    assert eng.device_verify.num_used > 0
    if pausing:
        assert sum(held) > 0, "no deferred catch-up was caught up before a built step"
    else:
        assert steps == host_steps


@pytest.fixture(scope="module")
def mtp_target(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("dsv3_mtp_device_loop"))
    make_deepseek_checkpoint(path, mtp_agreement=0.01, layer_scale=0.02)
    return path


@pytest.mark.parametrize("k", [1, 3])
def test_mtp_loop_drafts_as_the_host(mtp_target: str, k: int) -> None:
    """A DeepSeek-V3 MTP layer (MLA target) through the loop: the host path's drafts step for
    step, plain decoding's outputs."""
    prompts = make_prompts(3, seed=2)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    plain = outputs(LLM(model=mtp_target, device="cpu"), prompts, params)
    spec = {"method": "mtp", "num_speculative_tokens": k, "adaptive_draft_length": False}
    host_out, host_steps, _ = _recorded_run(mtp_target, spec, False, prompts, params)
    out, steps, eng = _recorded_run(mtp_target, spec, True, prompts, params)
    assert host_out == plain and out == plain and steps == host_steps
    assert eng.device_verify.layer is not None and eng.device_verify.num_used > 0
    assert eng.stats()["num_accepted_tokens"] > 0
