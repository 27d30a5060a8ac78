"""Qwen3-Next (Gated DeltaNet hybrid): tiny random HF checkpoints as the oracle, and lossless ngram
and MTP speculation through the recurrent-state pool, tests named after the bug classes that hit
other engines (../shared/reference/families.md): a row with no drafts right after an accepted run,
mixed batches where rows with and without drafts share a step, prefill rows next to verify rows,
partial acceptance at every position, preemption; block sizes 1/4/16; batch 1, 8 and 32."""
from __future__ import annotations

import pytest
import torch
import transformers

from pyengine import LLM, SamplingParams, ops
from pyengine.loader import load_model
from pyengine.models.qwen3_next import Qwen3NextForCausalLM, invariant_gemm_misfits, qwen3_next_model_config
from pyengine.ops.kernel_config import KernelConfig, use_kernel_config
from tests.hybrid_spec_checks import SCRIPTED_CASES, check_greedy_matches_hf_generate, check_ngram_ragged, check_scripted
from tests.spec_harness import assert_lossless, check_second_token_follows_target, run
from tests.tiny_models import QWEN3_NEXT, make_prompts, make_qwen3_5_checkpoint, make_qwen3_next_checkpoint
from tests.utils_paged import make_meta

PROMPT = [5, 17, 3, 88, 41, 41, 9, 60, 2, 33, 71, 12, 7, 50, 29, 94, 18, 3, 66, 40, 21] * 4  # 84: > one chunk of 64
CASES = {
    "moe_every_layer": {},
    "dense_layers_and_tied": dict(mlp_only_layers=[0, 2], tie_word_embeddings=True, linear_num_value_heads=2),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(request.param))
    return request.param, path, make_qwen3_next_checkpoint(path, **CASES[request.param])


@pytest.fixture(scope="module")
def spec_model(tmp_path_factory) -> str:
    """Small layer outputs (greedy runs fall into loops ngram finds) and an MTP layer that agrees
    with the target about half the time."""
    path = str(tmp_path_factory.mktemp("qwen3_next_mtp"))
    make_qwen3_next_checkpoint(path, mtp_agreement=0.01, layer_scale=0.01)
    return path


def test_prefill_logits_match_hf(pair) -> None:
    case, path, hf = pair
    model, config, _ = load_model(path, "cpu", torch.float32)
    meta, positions = make_meta([(list(range(3, 25)), 0, len(PROMPT))], 4)
    caches = model.make_kv_caches(32, 4, torch.device("cpu"))
    logits = model.compute_logits(model(torch.tensor(PROMPT), positions, meta, caches))
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0].float()
    torch.testing.assert_close(logits, ref, atol=2e-4, rtol=2e-4)
    assert config.layer_types.count("full_attention") == 2


@pytest.mark.parametrize("moe,multimodal", [(False, False), (True, True), (False, True)],
                         ids=["qwen3_5_text", "qwen3_5_moe_multimodal", "qwen3_5_multimodal"])
def test_qwen3_5_text_part_matches_hf(tmp_path, moe: bool, multimodal: bool) -> None:
    """Qwen3.5: delta-rule projections stored apart; a multimodal checkpoint's text part loads
    (vision tower skipped) and its logits equal the HF model's on a text-only prompt."""
    path = str(tmp_path / "q35")
    hf = make_qwen3_5_checkpoint(path, moe=moe, multimodal=multimodal)
    model, config, _ = load_model(path, "cpu", torch.float32)
    meta, positions = make_meta([(list(range(3, 25)), 0, len(PROMPT))], 4)
    logits = model.compute_logits(model(torch.tensor(PROMPT), positions, meta, model.make_kv_caches(32, 4, torch.device("cpu"))))
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([PROMPT])).logits[0].float()
    torch.testing.assert_close(logits, ref, atol=2e-4, rtol=2e-4)
    assert config.split_projections and (config.moe is not None) == moe


def test_qwen3_5_mtp_greedy_equals_plain(tmp_path) -> None:
    """Qwen3.5 (delta-rule projections apart, dense MLP) speculates with its own mtp.* layer."""
    path = str(tmp_path / "q35_mtp")
    make_qwen3_5_checkpoint(path, moe=False, multimodal=False, layer_scale=0.01, mtp_agreement=0.01)
    prompts = make_prompts(8, seed=5)
    kw = dict(max_tokens=20, block_size=4, max_model_len=128, max_num_batched_tokens=48)
    plain = run(path, prompts, **kw)[0]
    spec = {"method": "mtp", "num_speculative_tokens": 3, "adaptive_draft_length": False}
    outs, st, _, llm = run(path, prompts, spec=spec, **kw)
    assert_lossless(llm, prompts, plain, outs)
    assert 0 < st["acceptance_rate"] < 1, st


def test_greedy_matches_hf_generate(pair) -> None:
    check_greedy_matches_hf_generate(pair[1], pair[2])


def test_state_and_kv_only_where_used(pair) -> None:
    """Delta-rule layers get state slots and no KV cache; attention layers the reverse."""
    llm = LLM(pair[1], device="cpu", max_num_seqs=4, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    runner = llm.engine.runner
    kinds = llm.model_config.layer_types
    assert [c is None for c in runner.kv_caches] == [t == "linear_attention" for t in kinds]
    assert [s is None for s in runner.state_cache.ssm] == [t == "full_attention" for t in kinds]
    assert runner.state_cache.num_running_slots == 4 * 3 and llm.engine.cfg.enable_prefix_caching
    assert runner.state_cache.num_slots == 4 * 3 + llm.engine.cfg.num_state_checkpoints


def test_ngram_ragged_batch8(spec_model: str) -> None:
    check_ngram_ragged(spec_model)


@pytest.mark.parametrize("name,pattern,budget", SCRIPTED_CASES, ids=[c[0] for c in SCRIPTED_CASES])
def test_scripted_acceptance_patterns(spec_model: str, name: str, pattern: list[int], budget: int) -> None:
    check_scripted(spec_model, name, pattern, budget)


@pytest.mark.parametrize("batch,k,block_size", [(1, 3, 16), (8, 2, 1), (8, 4, 4), (32, 3, 16)])
def test_mtp_greedy_equals_plain(spec_model: str, batch: int, k: int, block_size: int) -> None:
    prompts = make_prompts(batch, seed=4)
    kw = dict(max_tokens=20, block_size=block_size, max_model_len=128, max_num_batched_tokens=48)
    plain = run(spec_model, prompts, **kw)[0]
    spec = {"method": "mtp", "num_speculative_tokens": k, "adaptive_draft_length": False}
    outs, st, rec, llm = run(spec_model, prompts, spec=spec, **kw)
    assert_lossless(llm, prompts, plain, outs)
    assert 0 < st["acceptance_rate"] < 1, st
    if batch > 1:
        assert rec.had_mixed_step(), "no step verified drafts next to a prefill"
    rows = rec.verify_rows()
    assert any(c - 1 < d for _, _, d, c in rows) and any(c - 1 == d for _, _, d, c in rows)


def test_mtp_preemption(spec_model: str) -> None:
    """Few KV blocks: requests are preempted and re-prefilled (their state slots and MTP positions
    start over)."""
    prompts = make_prompts(8, seed=6)
    kw = dict(max_tokens=20, block_size=4, max_model_len=128, max_num_batched_tokens=32)
    plain = run(spec_model, prompts, **kw)[0]
    spec = {"method": "mtp", "num_speculative_tokens": 3, "adaptive_draft_length": False}
    outs, st, _, llm = run(spec_model, prompts, spec=spec, num_kv_blocks=36, **kw)
    assert_lossless(llm, prompts, plain, outs)
    assert st["num_preemptions"] > 0


def test_random_sampling_with_mtp_keeps_target_distribution(spec_model: str) -> None:
    check_second_token_follows_target(spec_model, {"method": "mtp", "num_speculative_tokens": 2,
                                              "adaptive_draft_length": False}, [5, 17, 3, 88, 41, 9])


def test_random_sampling_with_ngram_keeps_target_distribution(spec_model: str) -> None:
    prompt = torch.randperm(96, generator=torch.Generator().manual_seed(0)).tolist()  # every token once: any
    spec = {"method": "ngram", "num_speculative_tokens": 2, "adaptive_draft_length": False,  # first token gets a
            "prompt_lookup_min": 1, "prompt_lookup_max": 2}  # prompt-lookup draft
    check_second_token_follows_target(spec_model, spec, prompt)


def _bare_model(dtype: torch.dtype, **overrides) -> Qwen3NextForCausalLM:
    """An uninitialised Qwen3-Next of the tiny config (shapes only: nothing is run)."""
    hf = transformers.Qwen3NextConfig(**dict(QWEN3_NEXT, **overrides)).to_dict()
    return Qwen3NextForCausalLM(qwen3_next_model_config(dict(hf, architectures=["Qwen3NextForCausalLM"])), dtype)


def test_batch_invariant_cuda_refuses_widths_the_invariant_gemm_does_not_take() -> None:
    """prepack_for_cuda's check: in bf16 the default tiny widths name out_proj (K 96), the experts'
    w_down (K 32) and the shared expert's down_proj (K 48); aligned widths, and fp32, pass; a tied
    lm_head is checked as its [in, out] transpose (N = vocab); the shared expert gate (N 1) is padded
    at the call."""
    misfits = invariant_gemm_misfits(_bare_model(torch.bfloat16), None)
    assert {m.split(" ")[0].split(".", 2)[-1] for m in misfits} == {"mixer.out_proj", "mlp.w_down",
                                                                    "mlp.shared_experts.down_proj"}
    aligned = dict(head_dim=256, linear_key_head_dim=32, linear_value_head_dim=32, moe_intermediate_size=64,
                   shared_expert_intermediate_size=64)
    assert invariant_gemm_misfits(_bare_model(torch.bfloat16, **aligned), None) == []
    assert invariant_gemm_misfits(_bare_model(torch.float32), None) == []
    tied = _bare_model(torch.bfloat16, **aligned, tie_word_embeddings=True, vocab_size=100)
    assert invariant_gemm_misfits(tied, tied.embed_tokens.t()) == ["lm_head (tied) (64, 100)"]
    assert tied.prepack_for_cuda() is False and tied.packed_lm_head is None  # off CUDA: unchanged


@pytest.mark.parametrize("chunked", [True, False])
def test_prefill_entry_keeps_the_recurrence_on_the_cpu(chunked: bool) -> None:
    """ops.gated_delta_rule_prefill (the model's prefill call) on the CPU is gated_delta_rule_chunked
    (the recurrence token after token) bit for bit, whatever KernelConfig.gdn_chunked_prefill says:
    the chunk-wise kernel is CUDA's, outside batch_invariant."""
    gen = torch.Generator().manual_seed(1)
    lengths, h, hv, dk, dv = [5, 70, 1], 2, 4, 16, 24
    n = sum(lengths)
    q, k = torch.randn(n, h, dk, generator=gen), torch.randn(n, h, dk, generator=gen)
    v = torch.randn(n, hv, dv, generator=gen)
    g, beta = -torch.rand(n, hv, generator=gen), torch.rand(n, hv, generator=gen)
    qsl = torch.tensor([0, 5, 75, 76], dtype=torch.int32)
    idx, acc = torch.tensor([[0], [1], [2]], dtype=torch.int32), torch.ones(3, dtype=torch.int32)
    init = torch.tensor([True, False, True])
    base = torch.randn(3, hv, dv, dk, generator=gen) * 0.3
    got_state, want_state = base.clone(), base.clone()
    config = KernelConfig.from_value({"gdn_chunked_prefill": chunked})
    with use_kernel_config(config):
        got = ops.gated_delta_rule_prefill(q, k, v, g, beta, qsl, got_state, idx, acc, init)
        want = ops.gated_delta_rule_chunked(q, k, v, g, beta, qsl, want_state, idx, acc, init)
    assert torch.equal(got, want) and torch.equal(got_state, want_state)
    assert not torch.equal(got_state, base)  # the final states were written
