"""The draft-length policy proposes what pays, per request: full length when verify tokens are
nearly free and drafts are accepted, none for a request whose drafts are rejected or when verify
tokens cost real compute, and drafts again for a request whose acceptance recovers. Its step cost
comes from a cost model (or the user), never from a clock: the same inputs give the same lengths
in every run."""
from __future__ import annotations

import random
import time
from typing import Callable

import numpy as np
import pytest
import torch

from pyengine.spec_decode.config import SpeculativeConfig
from pyengine.spec_decode.draft_length import DraftLengthPolicy
from pyengine.spec_decode.step_cost import (CUDA_DEFAULT, DEFAULT_STEP_COST, device_rates,
                                               modelled_step_cost, weight_footprint)

# accept(row, step) -> the chance that each draft of that row is accepted (given the earlier ones were)
Acceptance = Callable[[int, int], float]


def simulate(k: int, rows: int, accept: float | Acceptance, cost: tuple[float, float], steps: int = 200,
             found: float = 1.0, policy: DraftLengthPolicy | None = None) -> np.ndarray:
    """Drive the policy with a synthetic engine whose step cost is a + b * tokens (the policy's
    step_cost); each draft of row i is accepted with probability accept(i, step) given the previous
    ones were; the proposer finds drafts for a row with probability `found`. Returns the lengths
    chosen, [steps, rows]."""
    rng = np.random.default_rng(0)
    policy = policy or DraftLengthPolicy(k, step_cost=cost)
    assert policy.cost_line() == cost
    rate: Acceptance = accept if callable(accept) else (lambda i, s: accept)
    slots = np.arange(rows)  # the scheduler's request slots
    seq_ids = slots + 100  # ids need not be dense
    chosen = np.zeros((steps, rows), dtype=np.int64)
    for step in range(steps):
        asked = policy.draft_lengths(slots, seq_ids)
        assert ((0 <= asked) & (asked <= k)).all()
        chosen[step] = asked
        drafts = np.where(rng.random(rows) < found, asked, 0)
        accepted = np.array([next((j for j in range(n) if rng.random() > rate(i, step)), n)
                             for i, n in enumerate(drafts)])
        policy.observe_rows(slots, drafts, accepted + 1)
    return chosen


def mostly(chosen: np.ndarray, value: int) -> bool:
    return (chosen == value).mean() >= 0.9


BANDWIDTH_BOUND = (0.016, 0.0002)  # batch 1 on a CPU: a token more costs little
COMPUTE_BOUND = (0.001, 0.002)  # time proportional to tokens


def test_bandwidth_bound_and_accepted_drafts_use_full_length() -> None:
    assert mostly(simulate(k=4, rows=1, accept=0.8, cost=BANDWIDTH_BOUND)[-100:], 4)


def test_poor_acceptance_proposes_nothing() -> None:
    assert mostly(simulate(k=4, rows=1, accept=0.0, cost=BANDWIDTH_BOUND)[-100:], 0)


def test_compute_bound_batch_proposes_nothing_at_moderate_acceptance() -> None:
    # 32 rows, step time proportional to tokens: a draft is worth it only if accepted > 1/1
    assert mostly(simulate(k=4, rows=32, accept=0.4, cost=COMPUTE_BOUND)[-100:], 0)


def test_intermediate_cost_picks_an_intermediate_length() -> None:
    chosen = simulate(k=8, rows=8, accept=0.6, cost=(0.02, 0.0015))[-100:].ravel().tolist()
    best = max(set(chosen), key=chosen.count)
    assert 0 < best < 8, chosen


def test_rows_that_never_accept_get_no_drafts_while_accepting_rows_keep_theirs() -> None:
    # Half the rows always accept, half never: only the accepting half speculates, at full length,
    # both where verify tokens are nearly free and where they cost compute.
    for rows, cost in ((8, BANDWIDTH_BOUND), (32, (0.01, 0.001))):
        chosen = simulate(k=4, rows=rows, accept=lambda i, s: 1.0 if i % 2 == 0 else 0.0, cost=cost)[-100:]
        assert mostly(chosen[:, 0::2], 4), (rows, chosen[:, 0::2].mean())
        assert mostly(chosen[:, 1::2], 0), (rows, chosen[:, 1::2].mean())


def test_a_row_whose_acceptance_recovers_gets_drafts_back() -> None:
    # Row 0 rejects everything for 150 steps, then accepts everything; row 1 always accepts.
    def accept(i: int, step: int) -> float:
        return 1.0 if i == 1 or step >= 150 else 0.0

    chosen = simulate(k=4, rows=2, accept=accept, cost=BANDWIDTH_BOUND, steps=400)
    assert mostly(chosen[100:150, 0], 0), chosen[100:150, 0]
    assert mostly(chosen[100:, 1], 4)
    assert mostly(chosen[-100:, 0], 4), chosen[150:, 0]  # back at full length, probes included


def test_recovery_in_a_compute_bound_batch_is_cheap_and_complete() -> None:
    # 16 rows, verify tokens cost compute: while no row accepts, probes add well under one token
    # per step; once every draft is accepted all rows return to full length.
    def accept(i: int, step: int) -> float:
        return 0.0 if step < 200 else 1.0

    chosen = simulate(k=4, rows=16, accept=accept, cost=(0.01, 0.001), steps=1200)
    assert chosen[100:200].sum(axis=1).mean() < 0.5, chosen[100:200].sum(axis=1)
    assert mostly(chosen[-100:], 4), chosen[-100:].mean()


def test_rows_without_proposals_do_not_stop_the_others() -> None:
    # The proposer finds drafts for a row only a third of the time: the drafts it does find are
    # accepted, so asking stays worthwhile (a miss costs nothing).
    assert mostly(simulate(k=4, rows=4, accept=0.9, cost=BANDWIDTH_BOUND, found=0.3)[-100:], 4)


def test_a_slot_taken_by_a_new_request_starts_afresh() -> None:
    policy = DraftLengthPolicy(4, step_cost=BANDWIDTH_BOUND)
    simulate(k=4, rows=2, accept=lambda i, s: 0.0 if i == 0 else 1.0, cost=BANDWIDTH_BOUND, steps=60, policy=policy)
    assert policy.row_acceptance(0)[0] < 0.1 < 0.9 < policy.row_acceptance(1)[0]
    # Requests 100 and 101 finished; 7 now holds slot 0: it starts at the batch's estimate.
    policy.draft_lengths(np.array([0, 1]), np.array([7, 101]))
    batch = (policy.pool_accepts / policy.pool_trials).cumprod()
    np.testing.assert_allclose(policy.row_acceptance(0), batch)
    assert policy.row_acceptance(1)[0] > 0.9, "the request that kept its slot kept its evidence"


def test_rows_that_cannot_finish_last_get_nothing() -> None:
    """The engine marks rows that finish before another row whatever happens: their drafts could
    not shorten the run, so they get none, while the others keep the full length (and no probe)."""
    policy = DraftLengthPolicy(4, step_cost=BANDWIDTH_BOUND)
    simulate(k=4, rows=3, accept=1.0, cost=BANDWIDTH_BOUND, steps=30, policy=policy)
    slots, seq_ids = np.arange(3), np.arange(100, 103)
    assert policy.draft_lengths(slots, seq_ids).tolist() == [4, 4, 4]
    assert policy.draft_lengths(slots, seq_ids, np.array([True, False, True])).tolist() == [4, 0, 4]
    assert policy.probes[1] == -1


# ---- the step cost: only b / a matters, from a cost model or the user, never from a clock --------

def test_only_the_ratio_b_over_a_matters() -> None:
    for cost in (BANDWIDTH_BOUND, (0.01, 0.001), COMPUTE_BOUND):
        scaled = (cost[0] * 1e3, cost[1] * 1e3)
        for accept in (0.4, 0.8):
            np.testing.assert_array_equal(simulate(k=4, rows=8, accept=accept, cost=cost, steps=80),
                                          simulate(k=4, rows=8, accept=accept, cost=scaled, steps=80))


def test_the_step_cost_decides_and_no_cost_is_the_default() -> None:
    """Same rows, same acceptance: cheap verify tokens give full length, dear ones none."""
    assert mostly(simulate(k=4, rows=8, accept=0.6, cost=(1.0, 0.0))[-100:], 4)
    assert mostly(simulate(k=4, rows=8, accept=0.6, cost=(0.001, 1.0))[-100:], 0)
    assert DraftLengthPolicy(4).cost_line() == DEFAULT_STEP_COST


@pytest.mark.parametrize("bad", [(0.0, 0.001), (-1.0, 0.1), (0.01, -0.001), (float("nan"), 0.1),
                                 (0.01, float("inf")), (0.01,), (0.01, 0.001, 0.1), "0.01,0.001", 0.01,
                                 (True, 0.1), ("0.01", "0.001")])
def test_bad_step_cost_raises(bad) -> None:
    with pytest.raises(ValueError, match="speculative_config.step_cost"):
        SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4, "step_cost": bad})
    with pytest.raises(ValueError, match="step_cost"):
        DraftLengthPolicy(4, step_cost=bad)


def test_good_step_cost_is_kept() -> None:
    cfg = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4, "step_cost": [0.02, 0.001]})
    assert cfg.step_cost == (0.02, 0.001)
    assert SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4}).step_cost is None
    assert DraftLengthPolicy(4, step_cost=(1, 0)).cost_line() == (1.0, 0.0)


H100, H200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"
SIZES = [135_000_000, 8_000_000_000, 70_000_000_000]  # parameters


def ratio(cost: tuple[float, float]) -> float:
    return cost[1] / cost[0]


def test_cost_model_verify_tokens_are_dearer_on_a_cpu_than_on_an_h100() -> None:
    """The same model in the same dtype: one more token fed costs a larger share of the step on a
    CPU of up to 16 cores (fewer FLOP/s per byte of bandwidth) than on an H100. (A server CPU of
    many cores has more FLOP/s per byte than an H100's fp32 units without tensor cores; against
    its 16-bit tensor cores, the GPU's default dtype, every CPU has fewer.)"""
    for params in SIZES:
        for dtype, width in ((torch.float32, 4), (torch.bfloat16, 2)):
            gpu = modelled_step_cost(params, params * width, "cuda", dtype, device_name=H100)
            for cores in (1, 2, 8, 16):
                for capability in ("AVX512", "AVX2", "DEFAULT"):
                    cpu = modelled_step_cost(params, params * width, "cpu", dtype, cpu_cores=cores,
                                             cpu_capability=capability)
                    assert ratio(cpu) > ratio(gpu), (params, dtype, cores, capability, cpu, gpu)
        gpu_bf16 = modelled_step_cost(params, params * 2, "cuda", torch.bfloat16, device_name=H100)
        for cores in (32, 128):
            for dtype, width in ((torch.float32, 4), (torch.bfloat16, 2)):
                cpu = modelled_step_cost(params, params * width, "cpu", dtype, cpu_cores=cores, cpu_capability="AVX512")
                assert ratio(cpu) > ratio(gpu_bf16), (params, dtype, cores, cpu, gpu_bf16)
        # 16-bit on an H100: tokens nearly free; fp32 (no tensor cores) makes them dearer
        assert ratio(gpu_bf16) < ratio(modelled_step_cost(params, params * 4, "cuda", torch.float32, device_name=H100))
    # a wider SIMD: cheaper tokens
    avx2, avx512 = (modelled_step_cost(10**9, 4 * 10**9, "cpu", torch.float32, cpu_cores=8, cpu_capability=c)
                    for c in ("AVX2", "AVX512"))
    assert ratio(avx512) < ratio(avx2)


def test_cost_model_device_table() -> None:
    assert device_rates("cuda", device_name=H200) != device_rates("cuda", device_name=H100)
    assert device_rates("cuda", device_name="NVIDIA H100 PCIe").bandwidth < device_rates("cuda", device_name=H100).bandwidth
    assert device_rates("cuda", device_name="NVIDIA GeForce RTX 3090") == CUDA_DEFAULT
    # the default for other CUDA devices is conservative: verify tokens look dearer than on an H100
    for dtype in (torch.bfloat16, torch.float32):
        other = modelled_step_cost(8 * 10**9, 16 * 10**9, "cuda", dtype, device_name="Some GPU")
        assert ratio(other) > ratio(modelled_step_cost(8 * 10**9, 16 * 10**9, "cuda", dtype, device_name=H100))
    # H200: more bandwidth, the same compute: tokens relatively dearer than on an H100
    assert ratio(modelled_step_cost(8 * 10**9, 16 * 10**9, "cuda", torch.bfloat16, device_name=H200)) > \
        ratio(modelled_step_cost(8 * 10**9, 16 * 10**9, "cuda", torch.bfloat16, device_name=H100))


def test_weight_footprint_counts_each_weight_once_and_one_vocabulary_table() -> None:
    class Toy(torch.nn.Module):
        def __init__(self, tied: bool) -> None:
            super().__init__()
            self.embed_tokens = torch.nn.Parameter(torch.zeros(100, 8), requires_grad=False)
            self.lm_head = self.embed_tokens if tied else torch.nn.Parameter(torch.zeros(8, 100), requires_grad=False)
            self.proj = torch.nn.Linear(8, 16, bias=True)  # weight counted, bias (1-D) not
            self.norm = torch.nn.Parameter(torch.ones(8))
            self.prepacked = torch.zeros(16, 8, dtype=torch.bfloat16)  # a plain attribute (a packed weight)
            self.register_buffer("cos_table", torch.zeros(64, 8))  # rope tables are not weights

    for tied in (True, False):
        assert weight_footprint(Toy(tied)) == (800 + 128 + 128, 800 * 4 + 128 * 4 + 128 * 2)


def test_opt_in_calibration_samples_replace_the_step_cost() -> None:
    """observe_step is never called by the engine; samples given to it (e.g. an offline benchmark)
    replace step_cost once they span two token counts."""
    policy = DraftLengthPolicy(4, step_cost=(1.0, 0.5))
    policy.observe_step(8, 0.01 + 0.001 * 8)
    assert policy.cost_line() == (1.0, 0.5)
    policy.observe_step(20, 0.01 + 0.001 * 20)
    np.testing.assert_allclose(policy.cost_line(), (0.01, 0.001))


# ---- the engine ------------------------------------------------------------------------------------

PROMPTS = [
    "The cat sat on the mat. The cat sat on the mat. The cat sat on the",
    "one two three four one two three four one two three four one two",
    "Write a short story about a robot who learns to paint.",
    "Paris is the capital of France. Berlin is the capital of Germany. Rome is the capital of",
    "a b c d e f g a b c d e f g a b c d e f g a b c",
]


def run_recording(monkeypatch, model: str, spec: dict, prompts: list, max_tokens: int,
                  erratic_clock: bool = False, reuse=None):
    """Generate greedily with a fresh LLM (reuse: an LLM whose loaded model to run a fresh engine
    on); returns (the draft lengths of every step, the tokens, the LLM). erratic_clock:
    time.perf_counter returns erratic (monotonic) values meanwhile."""
    from pyengine import LLM, SamplingParams
    from pyengine.engine.llm_engine import LLMEngine

    plans: list[list[int]] = []
    original = DraftLengthPolicy.draft_lengths

    def recording(self, *args, **kwargs):
        lengths = original(self, *args, **kwargs)
        plans.append(lengths.tolist())
        return lengths

    with monkeypatch.context() as m:
        m.setattr(DraftLengthPolicy, "draft_lengths", recording)
        if reuse is None:
            llm = LLM(model=model, dtype="float32", device="cpu", speculative_config=spec)
        else:
            llm, old = reuse, reuse.engine
            llm.engine = LLMEngine(old.runner, old.model_config, old.tokenizer, old.cfg)
        if erratic_clock:
            rng, clock = random.Random(1), [1000.0]

            def perf_counter() -> float:  # every interval a surprise: 1 us .. 5 s
                clock[0] += rng.choice([1e-6, 1e-4, 2e-3, 0.05, 0.7, 5.0])
                return clock[0]

            m.setattr(time, "perf_counter", perf_counter)
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                            use_tqdm=False)
    return plans, [o.outputs[0].token_ids for o in outs], llm


def test_engine_draft_lengths_do_not_depend_on_the_clock(monkeypatch, smollm2_path: str) -> None:
    """The default model, ngram k = 4, adaptive lengths: the same prompts twice, once with an erratic
    clock, give the same draft lengths at every step (before: a line fitted to the steps' wall-clock
    times chose them, and this failed)."""
    spec = {"method": "ngram", "num_speculative_tokens": 4, "adaptive_draft_length": True,
            "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    plans, tokens, llm = run_recording(monkeypatch, smollm2_path, spec, PROMPTS, 24)
    # a fresh engine on the same loaded model (loading takes most of the time)
    first_engine = llm.engine
    plans_erratic, tokens_erratic, _ = run_recording(monkeypatch, smollm2_path, spec, PROMPTS, 24,
                                                     erratic_clock=True, reuse=llm)
    assert llm.engine is not first_engine and llm.engine.draft_length is not first_engine.draft_length
    assert tokens == tokens_erratic
    assert plans == plans_erratic
    assert any(0 < sum(p) < 4 * len(p) for p in plans[DraftLengthPolicy.WARMUP_STEPS:]), \
        "past the warm-up, lengths never between none and all: the test proves nothing"
    # the policy's line is the cost model's, for this model on this CPU
    from pyengine.spec_decode.step_cost import runner_step_cost

    assert llm.engine.draft_length.cost_line() == runner_step_cost(llm.engine.runner)


def test_engine_uses_the_users_step_cost(monkeypatch, tmp_path) -> None:
    """speculative_config.step_cost replaces the modelled cost: verify tokens that cost 1000x the
    step get no drafts past the warm-up; free ones get all k (one request: it always may finish last)."""
    from tests.tiny_models import make_checkpoint

    make_checkpoint("llama_gqa_untied", str(tmp_path))
    prompts = [[5, 6, 7, 8] * 6]
    warm = DraftLengthPolicy.WARMUP_STEPS
    lengths = {}
    for cost in ((0.001, 1.0), (1.0, 0.0)):
        spec = {"method": "ngram", "num_speculative_tokens": 4, "step_cost": cost, "prompt_lookup_min": 1}
        plans, _, llm = run_recording(monkeypatch, str(tmp_path), spec, prompts, 24)
        assert llm.engine.draft_length.cost_line() == cost
        lengths[cost] = [x for p in plans[warm:] for x in p]
    dear, free = lengths[(0.001, 1.0)], lengths[(1.0, 0.0)]
    assert len(dear) >= 10 and set(dear) == {0}, dear
    assert len(free) >= 10 and set(free) == {4}, free


def test_a_drafting_models_forwards_are_weighed() -> None:
    """A proposer that runs a drafting model or layer (MTP, EAGLE-3, a draft model) pays a forward for
    the catch-up and one per further draft depth, shared by the step's rows: drafts that pay when
    proposing is free are fewer where a forward costs a tenth of a step, and stop where it costs
    most of one."""
    cost = (1.0, 0.02)

    def drafts(rows: int, drafter_cost: float) -> float:
        p = DraftLengthPolicy(4, step_cost=cost, drafter_cost=drafter_cost)
        return simulate(k=4, rows=rows, accept=0.6, cost=cost, policy=p, steps=300)[-100:].mean()

    for rows in (1, 4):
        free, cheap, dear = drafts(rows, 0.0), drafts(rows, 0.1), drafts(rows, 0.8)
        assert free > 2.5 and 1.0 < cheap < free and dear < 0.25, (rows, free, cheap, dear)  # dear: probes only
