"""Prefix caching for hybrid models (issue 22), end to end on the CPU: every request's tokens and
logits with prefix caching equal those without it, bit for bit, while later requests restore the
recurrent state checkpointed at the positions earlier requests reached - under speculation too,
where the bugs of other engines live: accepted drafts crossing a checkpoint position, acceptance
stopping just below one or ending exactly on one, several positions in one step (block size 1),
preemption and readmission from a cached position, batch 8, ngram and MTP. And speculation does not
change the hit rate.

Two phases per run: phase 1 decodes a few prompts; phase 2 sends each phase-1 prompt extended by a
growing part of its output, so that its prefix hit ends at positions phase 1 reached in prefill
chunks and in verify steps."""
from __future__ import annotations

from typing import Any

import pytest
import torch

from pyengine import SamplingParams
from tests.spec_harness import RecordingScheduler
from tests.scripted_proposer import make_llm
from tests.test_bamba import make_bamba_checkpoint
from tests.test_mamba2 import make_mamba2_checkpoint
from tests.test_spec_decode import scripted
from tests.tiny_models import make_prompts, make_qwen3_next_checkpoint

K = 3
PHASE1_TOKENS, PHASE2_TOKENS = 16, 6
EXTENSIONS = (1, 3, 6, 9, 12)  # phase-2 prompt = phase-1 prompt + this many of its output tokens
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "adaptive_draft_length": False,
         "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def mamba2(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("pc_mamba2"))
    make_mamba2_checkpoint(path)
    return path


@pytest.fixture(scope="module")
def bamba(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("pc_bamba"))
    make_bamba_checkpoint(path)
    return path


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("pc_qwen3_next"))
    make_qwen3_next_checkpoint(path, mtp_agreement=0.01, layer_scale=0.01)
    return path


def run_phases(path: str, phases: list[list[list[int]]], max_tokens: list[int], prefix_caching: bool,
               block_size: int, spec: dict | None = None, **llm_kw: Any) -> tuple[list, list, dict, RecordingScheduler, Any]:
    """Greedy runs of each phase in turn on one LLM: (token ids, logits [n, vocab]) per request in
    order, the engine's stats, the recorded steps and the LLM."""
    kw = dict(device="cpu", max_model_len=128, max_num_seqs=8)
    if prefix_caching:
        kw.update(num_state_checkpoints=256, state_checkpoint_interval=block_size)
    kw.update((k, v) for k, v in llm_kw.items() if prefix_caching or "state" not in k)
    llm = make_llm(path, spec, block_size=block_size, enable_prefix_caching=prefix_caching, **kw)
    llm.engine.cfg.record_logits = True
    rec = RecordingScheduler(llm.engine.scheduler)
    llm.engine.scheduler = rec
    tokens, logits = [], []
    for prompts, n in zip(phases, max_tokens):
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)] * len(prompts)
        for r in llm.run_requests([(None, p) for p in prompts], params):
            assert r.error is None, r.error
            tokens.append(list(r.output_token_ids))
            logits.append(torch.stack([t.clone() for t in r.logits]))
    return tokens, logits, llm.stats(), rec, llm


def two_phase_prompts(path: str, n: int, seed: int, **llm_kw: Any) -> tuple[list[list[int]], list[list[int]], dict]:
    """(phase-1 prompts, phase-2 prompts, the scripted proposer's reference per request id)."""
    prompts = [p + [7, 11] for p in make_prompts(n, seed)]  # at least 3 tokens
    plain, *_ = run_phases(path, [prompts], [PHASE1_TOKENS + PHASE2_TOKENS], False, 4, **llm_kw)
    phase2, reference = [], {i: (len(p), out) for i, (p, out) in enumerate(zip(prompts, plain))}
    for p, out in zip(prompts, plain):
        for j in EXTENSIONS:
            reference[len(prompts) + len(phase2)] = (len(p) + j, out[j:])
            phase2.append(p + out[:j])
    return prompts, phase2, reference


def assert_same_bits(a: tuple, b: tuple) -> None:
    (tok_a, log_a, *_), (tok_b, log_b, *_) = a, b
    assert tok_a == tok_b
    for i, (x, y) in enumerate(zip(log_a, log_b)):
        assert torch.equal(x, y), f"request {i}: logits differ (max {float((x - y).abs().max())})"


def max_hit(prompt_len: int, block_size: int) -> int:
    return (prompt_len - 1) // block_size * block_size


@pytest.mark.parametrize("block_size", [1, 4])
def test_scripted_acceptance_around_checkpoint_positions(mamba2: str, block_size: int) -> None:
    phase1, phase2, reference = two_phase_prompts(mamba2, 4, seed=3)
    spec = {"method": "scripted", "num_speculative_tokens": K, "script": scripted(reference, K, [0, 1, 2, 3])}
    args = ([phase1, phase2], [PHASE1_TOKENS, PHASE2_TOKENS])
    off = run_phases(mamba2, *args, False, block_size, spec)
    on = run_phases(mamba2, *args, True, block_size, spec)
    assert_same_bits(on, off)
    stats, rec = on[2], on[3]
    # every phase-2 request restored a state, at the last position before its last token
    hits = [max_hit(len(p), block_size) for p in phase2]
    assert stats["num_state_restores"] == sum(h > 0 for h in hits)
    assert stats["prefix_cache_hit_tokens"] == sum(hits)
    # the verify steps of phase 1 covered each case around a checkpoint position
    B = block_size
    rows = [(nc, n, d, c) for nc, n, d, c in rec.verify_rows()]
    crossed = [(nc, c) for nc, n, d, c in rows if (nc + c) // B > nc // B]
    assert any(c == d + 1 for nc, n, d, c in rows if (nc + c) // B > nc // B), "no fully accepted run crossed one"
    assert any((nc + n) // B > (nc + c) // B for nc, n, d, c in rows), "no acceptance stopped below one"
    assert any((nc + c) % B == 0 for nc, c in crossed), "no acceptance ended exactly on one"
    if B == 1:
        assert any(c >= 2 for _, c in crossed), "no step reached several positions"


def test_ngram_batch8_and_hit_rate_equal_to_plain(bamba: str) -> None:
    """Bamba (attention + Mamba2 layers), batch 8: ngram speculation with prefix caching equals plain
    decoding without it, and its hit rate equals plain decoding's with prefix caching."""
    phase1, phase2, _ = two_phase_prompts(bamba, 8, seed=5)
    args = ([phase1, phase2], [PHASE1_TOKENS, PHASE2_TOKENS])
    plain_off = run_phases(bamba, *args, False, 4)
    plain_on = run_phases(bamba, *args, True, 4)
    spec_on = run_phases(bamba, *args, True, 4, NGRAM)
    assert_same_bits(plain_on, plain_off)
    assert_same_bits(spec_on, plain_off)
    assert spec_on[2]["num_accepted_tokens"] > 0
    hits = [max_hit(len(p), 4) for p in phase2]
    assert spec_on[2]["num_state_restores"] == plain_on[2]["num_state_restores"] == sum(h > 0 for h in hits)
    assert spec_on[2]["prefix_cache_hit_tokens"] == sum(hits)
    assert spec_on[2]["prefix_cache_hit_rate"] == plain_on[2]["prefix_cache_hit_rate"] > 0.5


def test_preemption_and_readmission_from_a_cached_position(bamba: str) -> None:
    """A KV pool small enough to preempt: preempted requests come back through prefix hits on
    their own checkpointed positions; every output still equals plain decoding without caching."""
    phase1, phase2, _ = two_phase_prompts(bamba, 8, seed=5)
    args = ([phase1, phase2], [PHASE1_TOKENS, PHASE2_TOKENS])
    kw = dict(num_kv_blocks=40, max_num_batched_tokens=48)
    plain_off = run_phases(bamba, *args, False, 4, None, **kw)
    for spec in (None, NGRAM):
        on = run_phases(bamba, *args, True, 4, spec, **kw)
        assert_same_bits(on, plain_off)
        assert on[2]["num_preemptions"] > 0 and on[2]["num_state_restores"] > 0


def test_mtp_with_prefix_caching_equals_plain_and_keeps_the_hit_rate(qwen3_next: str) -> None:
    """Qwen3-Next (Gated DeltaNet + attention + MoE) speculating with its MTP layer, k drafts every
    step (the adaptive policy weighs the layer's forwards, which at these tiny widths cost about a
    target step: it would draft next to nothing)."""
    phase1, phase2, _ = two_phase_prompts(qwen3_next, 3, seed=7)
    args = ([phase1, phase2], [PHASE1_TOKENS, PHASE2_TOKENS])
    plain_off = run_phases(qwen3_next, *args, False, 4)
    plain_on = run_phases(qwen3_next, *args, True, 4)
    mtp_on = run_phases(qwen3_next, *args, True, 4,
                        {"method": "mtp", "num_speculative_tokens": 2, "adaptive_draft_length": False})
    assert_same_bits(plain_on, plain_off)
    assert_same_bits(mtp_on, plain_off)
    assert mtp_on[2]["num_draft_tokens"] > 0
    assert mtp_on[2]["prefix_cache_hit_rate"] == plain_on[2]["prefix_cache_hit_rate"] > 0.5


def test_a_tiny_checkpoint_pool_never_fails_a_request(mamba2: str) -> None:
    """One checkpoint slot for 24 requests: checkpoints evict each other, hits are rarer, outputs
    never change and no request fails."""
    phase1, phase2, _ = two_phase_prompts(mamba2, 4, seed=9)
    args = ([phase1, phase2], [PHASE1_TOKENS, PHASE2_TOKENS])
    off = run_phases(mamba2, *args, False, 4)
    on = run_phases(mamba2, *args, True, 4, None, num_state_checkpoints=1)
    assert_same_bits(on, off)
    assert on[2]["num_state_restores"] < len(phase2)


@pytest.fixture(scope="module")
def nemotron_h(tmp_path_factory) -> str:
    from tests.test_nemotron_h import make_nemotron_h_checkpoint

    path = str(tmp_path_factory.mktemp("pc_nemotron_h"))
    make_nemotron_h_checkpoint(path)
    return path


def test_nemotron_h_prefix_caching_is_the_default_and_exact(nemotron_h: str) -> None:
    """Nemotron-H (Mamba2, attention without RoPE, relu^2 MLP): prefix caching on by default, with
    the default checkpoint interval (256, whole blocks) and an explicit one."""
    phase1, phase2, _ = two_phase_prompts(nemotron_h, 4, seed=11)
    args = ([phase1, phase2], [PHASE1_TOKENS, PHASE2_TOKENS])
    off = run_phases(nemotron_h, *args, False, 4)
    on = run_phases(nemotron_h, *args, True, 4, NGRAM)
    assert_same_bits(on, off)
    assert on[2]["num_state_restores"] > 0
    default = make_llm(nemotron_h, None, device="cpu", max_model_len=128, block_size=16)
    cfg = default.engine.cfg
    assert cfg.enable_prefix_caching and cfg.num_state_checkpoints > 0 and cfg.state_checkpoint_interval == 256


@pytest.mark.parametrize("kw,message", [
    (dict(state_checkpoint_interval=6), "state_checkpoint_interval must be a positive multiple of block_size"),
    (dict(state_checkpoint_interval=0), "state_checkpoint_interval must be a positive int"),
    (dict(num_state_checkpoints=-1), "num_state_checkpoints must be an int >= 0"),
    (dict(num_state_checkpoints=True), "num_state_checkpoints must be an int >= 0"),
])
def test_bad_checkpoint_settings_are_one_line_value_errors(mamba2: str, kw: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_llm(mamba2, None, device="cpu", max_model_len=64, block_size=4, **kw)


def test_checkpoint_settings_on_a_model_without_state_are_refused(tmp_path) -> None:
    from tests.tiny_models import make_checkpoint

    make_checkpoint("llama_gqa_untied", str(tmp_path))
    with pytest.raises(ValueError, match="keeps no recurrent state"):
        make_llm(str(tmp_path), None, device="cpu", max_model_len=64, num_state_checkpoints=4)
