"""Draft-model speculation (pyengine.spec_decode.draft_model): greedy output equals plain greedy decoding token for
token, with the target as its own draft (acceptance ~100%: proves the draft KV bookkeeping), a
perturbed copy (partial acceptance), and a draft of another architecture (no acceptance); batch 1
and 8, k = 1/3/5, block sizes 4 and 16, prefix caching on/off, preemption. Random sampling: the
first token after a verify step follows the target distribution (unit level, 3000 rows in one
batch), the drafts follow the processed draft distribution q, and acceptance matches sum min(p, q).
"""
from __future__ import annotations

import functools
import os
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from pyengine import LLM, SamplingParams, _C
from pyengine.spec_decode.draft_model import DraftModelProposer
from pyengine.loader import load_model
from pyengine.engine.model_runner import ModelRunner
from pyengine.spec_decode.rejection_sampler import RejectionSampler
from pyengine.engine.sampler import SamplingTensors, compute_probs
from pyengine.spec_decode.config import SpeculativeConfig
from tests.spec_harness import assert_follows, assert_lossless, run  # assert_lossless: divergence only at a top-2 gap < 1e-4
from tests.tiny_models import VOCAB, make_checkpoint, make_prompts
from tests.utils_paged import PagedCache, make_meta



def propose_all(proposer: DraftModelProposer, sched: _C.Scheduler, k: int) -> None:
    """Up to k drafts for every decode row of the scheduler (what the engine asks without a policy)."""
    view = sched.decode_view()
    proposer.propose(sched, view, np.full(view.num_rows, k, dtype=np.int32))

def _perturbed_copy(src: str, dst: str, scale: float, seed: int = 1) -> None:
    """The same checkpoint with Gaussian noise on every weight: a draft that agrees often, not always."""
    shutil.copytree(src, dst, dirs_exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    weights = load_file(os.path.join(src, "model.safetensors"))
    noisy = {n: (t + scale * torch.randn(t.shape, generator=gen)).contiguous() for n, t in weights.items()}
    save_file(noisy, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> SimpleNamespace:
    root = tmp_path_factory.mktemp("draft_models")
    target, other = str(root / "target"), str(root / "other")
    make_checkpoint("llama_gqa_untied", target)  # Llama, GQA 8/2 heads
    make_checkpoint("qwen3_qk_norm", other, seed=1)  # same vocab, another architecture and KV geometry
    perturbed = str(root / "perturbed")
    _perturbed_copy(target, perturbed, 0.006)  # ~50% acceptance at k = 3
    return SimpleNamespace(target=target, perturbed=perturbed, other=other)


@functools.lru_cache(maxsize=None)
def _plain(target: str, n: int, max_tokens: int) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(o) for o in run(target, make_prompts(n), max_tokens=max_tokens)[0])


def plain_reference(target: str, n: int, max_tokens: int = 24) -> list[list[int]]:
    return [list(o) for o in _plain(target, n, max_tokens)]


def run_draft(models: SimpleNamespace, draft: str, batch: int, k: int, block_size: int, prefix: bool,
              max_tokens: int = 24, **kw):
    prompts = make_prompts(batch)
    spec = {"adaptive_draft_length": False, "model": getattr(models, draft), "num_speculative_tokens": k}
    kw.setdefault("max_num_batched_tokens", 64)  # admits prompts over several steps: prefix hits, mixed batches
    outs, st, rec, llm = run(models.target, prompts, max_tokens=max_tokens, spec=spec, block_size=block_size,
                             enable_prefix_caching=prefix, **kw)
    assert_lossless(llm, prompts, plain_reference(models.target, batch, max_tokens), outs)
    assert st["num_draft_tokens"] > 0
    return outs, st, rec, llm


# ---------------------------------------------------------------- greedy == plain


# Every value of batch {1, 8}, k {1, 3, 5}, block size {4, 16} and prefix caching meets every other
# (pairwise), instead of the full 24-case product.
SELF_CASES = [(1, 1, 4, True), (1, 3, 16, False), (1, 5, 4, False), (1, 5, 16, True),
              (8, 1, 16, False), (8, 3, 4, True), (8, 3, 16, True), (8, 5, 4, False), (8, 5, 16, True), (8, 1, 4, True)]


@pytest.mark.parametrize("batch,k,block_size,prefix", SELF_CASES)
def test_self_draft_greedy_equals_plain(models, batch: int, k: int, block_size: int, prefix: bool) -> None:
    _, st, rec, _ = run_draft(models, "target", batch, k, block_size, prefix)
    # The draft IS the target: any draft-KV bookkeeping error (stale or missing positions,
    # wrong slots, trusting a prefix hit) shows up as rejected drafts.
    assert st["acceptance_rate"] > 0.95, st
    if batch > 1:
        assert rec.had_mixed_step(), "no step mixed prefill chunks with verify rows"
        if prefix:
            assert st["prefix_cache_hit_tokens"] > 0


@pytest.mark.parametrize("batch,k,block_size,prefix", [(1, 3, 4, True), (8, 3, 4, True), (8, 5, 16, False),
                                                       (8, 1, 4, False)])
def test_perturbed_draft_greedy_equals_plain(models, batch: int, k: int, block_size: int, prefix: bool) -> None:
    _, st, _, _ = run_draft(models, "perturbed", batch, k, block_size, prefix)
    assert 0.1 < st["acceptance_rate"] < 0.95, st  # partial acceptance: every resolution path of the draft KV


@pytest.mark.parametrize("batch,k,block_size", [(1, 5, 16), (8, 3, 4)])
def test_other_architecture_draft_greedy_equals_plain(models, batch: int, k: int, block_size: int) -> None:
    _, st, _, llm = run_draft(models, "other", batch, k, block_size, True)
    assert st["acceptance_rate"] < 0.5  # an unrelated random model: almost nothing accepted
    assert llm.engine.proposer.runner.kv_caches[0][0].shape[2:] != llm.engine.runner.kv_caches[0][0].shape[2:]


@pytest.mark.parametrize("draft,k", [("target", 3), ("perturbed", 4)])
def test_preemption(models, draft: str, k: int) -> None:
    _, st, _, _ = run_draft(models, draft, 8, k, 4, True, num_kv_blocks=24)
    assert st["num_preemptions"] > 0
    if draft == "target":
        assert st["acceptance_rate"] > 0.95, st  # preempted requests restart their draft KV from 0


# ---------------------------------------------------------------- random sampling, end to end


def test_random_sampling_self_draft(models) -> None:
    """q == p when the draft is the target: with the right q rows passed (draft_probs) almost every
    draft passes u * q < p (a one-hot q would pass only ~p(x), a misaligned q row much less). A tiny
    token budget trims drafts (ragged rows, fewer drafts than proposed). The same seed gives the
    same tokens."""
    prompts = [p[:6] for p in make_prompts(8, seed=3)]  # short: all 8 decode together
    spec = {"adaptive_draft_length": False, "model": models.target, "num_speculative_tokens": 5}
    params = SamplingParams(temperature=1.0, top_k=40, top_p=0.95, max_tokens=20, ignore_eos=True)
    kw = dict(spec=spec, params=params, block_size=4, max_num_batched_tokens=16)
    first, st, rec, _ = run(models.target, prompts, **kw)
    assert st["acceptance_rate"] > 0.95, st
    assert rec.had_ragged_step() and any(0 < d < 5 for s in rec.steps for d in s.num_drafts)
    assert run(models.target, prompts, **kw)[0] == first


def test_greedy_rows_of_a_mixed_batch_stay_exact(models) -> None:
    prompts = make_prompts(8)
    spec = {"adaptive_draft_length": False, "model": models.perturbed, "num_speculative_tokens": 3}
    mixed = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True) if i % 2 else
             SamplingParams(temperature=0.8, max_tokens=24, ignore_eos=True) for i in range(8)]
    outs = LLM(model=models.target, device="cpu", speculative_config=spec, block_size=4).generate(
        prompts, mixed, use_tqdm=False)
    plain = plain_reference(models.target, 8)
    for i in range(1, 8, 2):
        assert outs[i].outputs[0].token_ids == plain[i]


# ---------------------------------------------------------------- random sampling, unit level


@torch.inference_mode()
def _next_logits(model, config, tokens: list[int]) -> torch.Tensor:
    """Logits after `tokens` from a fresh contiguous forward (no engine, no draft cache)."""
    cache = PagedCache(config, len(tokens) // 16 + 2, 16, torch.float32)
    table: list[int] = []
    cache.grow(table, len(tokens))
    meta, pos = make_meta([(table, 0, len(tokens))], 16)
    hidden = model(torch.tensor(tokens), pos, meta, cache.kv_caches)
    return model.compute_logits(hidden[-1:])[0]


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True),
                                    SamplingParams(temperature=0.7, top_k=12, top_p=0.9, max_tokens=8, ignore_eos=True)],
                         ids=["t1", "t07_topk_topp"])
@torch.inference_mode()
def test_first_token_after_verify_follows_target(models, params: SamplingParams) -> None:
    """N identical requests (each its own target and draft generator) run one propose + verify step
    in one batch: draft 1 follows the processed draft distribution q, the first emitted token follows
    the processed target distribution p, and draft 1 is accepted with probability sum min(p, q)."""
    n, k, block = 3000, 3, 16
    prompt, t1 = [5, 17, 3, 88, 41, 9], 33
    model, config, _ = load_model(models.target, "cpu", torch.float32)
    draft_model, draft_config, _ = load_model(models.perturbed, "cpu", torch.float32)
    runner = ModelRunner(model, config, block, n + 8, torch.device("cpu"), torch.float32)
    sc = _C.SchedulerConfig()
    sc.max_num_seqs, sc.max_num_batched_tokens, sc.max_model_len = n, n * len(prompt), 64
    sc.block_size, sc.num_kv_blocks, sc.enable_prefix_caching = block, n + 8, False
    sc.num_spec_tokens, sc.drafter_lookahead = k, k
    sched = _C.Scheduler(sc)
    for i in range(n):
        sched.add_request(i, prompt, params.max_tokens, [], [], True, 0)
    runner.execute(sched.schedule())  # prefill: target KV of the prompt
    sched.update(np.full(n, t1, dtype=np.int32), np.ones(n, dtype=np.int32))  # a fixed first token

    request = SimpleNamespace(params=params, prompt_token_ids=prompt)
    spec = SpeculativeConfig(method="draft_model", num_speculative_tokens=k, model=models.perturbed)
    proposer = DraftModelProposer(spec, runner, lambda sid: request, seed=0, max_model_len=64,
                                  draft=(draft_model, draft_config))
    propose_all(proposer, sched, k)
    batch = sched.schedule()
    nd = batch.num_draft_tokens.astype(np.int64)
    assert (nd == k).all() and batch.num_decode_rows == n
    logits = runner.execute(batch)
    starts = batch.query_start_loc[:-1] + 1
    draft_ids = torch.from_numpy(batch.input_ids[(starts[:, None] + np.arange(k)).reshape(-1)])
    q_rows = proposer.draft_probs(batch.seq_ids.tolist(), nd.tolist())
    gens = [torch.Generator().manual_seed(10_000 + i) for i in range(n)]
    out = RejectionSampler()(logits, draft_ids, torch.from_numpy(nd), q_rows, [params] * n, gens)

    tensors = SamplingTensors.from_params([params], VOCAB)
    p = compute_probs(_next_logits(model, config, prompt + [t1])[None], tensors)[0]
    q = compute_probs(_next_logits(draft_model, draft_config, prompt + [t1])[None], tensors)[0]
    # q handed to the verifier is the processed draft distribution, row-aligned with the drafts
    torch.testing.assert_close(q_rows.view(n, k, VOCAB)[:, 0], q.expand(n, VOCAB), atol=1e-5, rtol=1e-4)
    drafts1 = draft_ids.view(n, k)[:, 0].numpy()
    assert_follows(drafts1, q, "draft token 1 ~ q")
    first = out.flat_tokens[torch.cumsum(out.num_tokens, 0) - out.num_tokens].numpy()
    assert_follows(first, p, "first emitted token ~ p")
    expected = float(torch.minimum(p, q).sum())
    accepted = float((out.num_accepted >= 1).double().mean())
    assert 0.2 < expected < 0.98  # the test has teeth: drafts are neither always nor never accepted
    assert abs(accepted - expected) < 5 * (expected * (1 - expected) / n) ** 0.5, (accepted, expected)


# ---------------------------------------------------------------- block invariant


@pytest.mark.parametrize("lookahead", [0, 3])
@torch.inference_mode()
def test_draft_writes_need_drafter_lookahead(models, lookahead: int) -> None:
    """The draft writes positions up to num_tokens + k - 2 before the step's append; only
    SchedulerConfig.drafter_lookahead = k guarantees those blocks exist, and the proposer checks it."""
    k, block, prompt = 3, 4, [5, 17, 3, 88]
    model, config, _ = load_model(models.target, "cpu", torch.float32)
    runner = ModelRunner(model, config, block, 64, torch.device("cpu"), torch.float32)
    sc = _C.SchedulerConfig()
    sc.max_model_len, sc.block_size, sc.num_kv_blocks = 64, block, 64
    sc.num_spec_tokens, sc.drafter_lookahead = k, lookahead
    sched = _C.Scheduler(sc)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    sched.add_request(0, prompt, params.max_tokens, [], [], True, 0)
    request = SimpleNamespace(params=params, prompt_token_ids=prompt)
    spec = SpeculativeConfig(method="draft_model", num_speculative_tokens=k, model=models.target)
    proposer = DraftModelProposer(spec, runner, lambda sid: request, 0, 64, draft=(model, config))

    def steps() -> None:
        for _ in range(8):
            propose_all(proposer, sched, k)
            batch = sched.schedule()
            d = int(batch.num_draft_tokens[0])
            logits = runner.execute(batch)
            drafts = torch.from_numpy(batch.input_ids[1:1 + d])
            out = RejectionSampler()(logits, drafts, [d], None, [params], [None])
            sched.update(out.flat_tokens.numpy().astype(np.int32), out.num_tokens.numpy().astype(np.int32))

    if lookahead >= k:
        steps()
        assert sched.stats()["num_accepted_tokens"] > 0
    else:
        with pytest.raises(AssertionError, match="drafter_lookahead"):
            steps()
