"""NemotronH layer pattern (Mamba2 "M", attention "*" without RoPE, relu^2 MLP "-") on CPU: HF
transformers' logits and greedy tokens on a tiny random model, and lossless speculative decoding."""
from __future__ import annotations

import pytest
import torch
import transformers

from pyengine import LLM, SamplingParams
from tests.spec_harness import assert_lossless, run
from tests.test_bamba import SEQS, forward_logits
from tests.hybrid_spec_checks import make_hybrid_checkpoint, plain, plain_from
from tests.test_spec_decode import make_prompts, scripted
from tests.tiny_models import VOCAB

NEMOTRON_H = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, hybrid_override_pattern="M*-M-*",
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, mamba_num_heads=8, mamba_head_dim=16,
                  n_groups=2, ssm_state_size=16, conv_kernel=4, chunk_size=8, max_position_embeddings=256,
                  time_step_min=0.05, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def make_nemotron_h_checkpoint(path: str, seed: int = 0) -> torch.nn.Module:
    # dt_bias around -3: some softplus(dt) fall below time_step_min, so the clamp matters
    return make_hybrid_checkpoint(path, transformers.NemotronHForCausalLM, transformers.NemotronHConfig(**NEMOTRON_H),
                                  seed, ("out_proj.weight", "o_proj.weight", "down_proj.weight"), out_std=0.02,
                                  dt_bias_mean=-3.0, dt_bias_std=2.0)


@pytest.fixture(scope="module")
def tiny_nemotron_h(tmp_path_factory) -> tuple[str, torch.nn.Module]:
    path = str(tmp_path_factory.mktemp("tiny_nemotron_h"))
    return path, make_nemotron_h_checkpoint(path)


@torch.inference_mode()
def test_logits_match_hf(tiny_nemotron_h) -> None:
    path, hf = tiny_nemotron_h
    ours, config = forward_logits(path, SEQS)
    assert config.architecture == "NemotronHForCausalLM" and config.attn_layer_indices == (1, 5)
    want = torch.cat([hf(torch.tensor([s])).logits[0] for s in SEQS])
    torch.testing.assert_close(ours, want, atol=1e-4, rtol=1e-4)


@torch.inference_mode()
def test_greedy_tokens_match_hf(tiny_nemotron_h) -> None:
    """Against HF's full (cache-free) forward: HF's cached decode path (seq_len == 1) skips the
    time_step_min clamp its prefill applies, so HF generate() disagrees with HF's own forward."""
    path, hf = tiny_nemotron_h
    prompts = [[5, 9, 33, 2, 71, 14], [40], [8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 12]]
    llm = LLM(model=path, device="cpu", max_model_len=128, block_size=4, max_num_batched_tokens=8)
    assert [c is None for c in llm.engine.runner.state_cache.conv] == [False, True, True, False, True, True]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        seq = list(prompt)
        for _ in range(12):
            seq.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))
        assert out.outputs[0].token_ids == seq[len(prompt):]


def test_ngram_greedy_equals_plain_batch8_ragged(tiny_nemotron_h) -> None:
    path, _ = tiny_nemotron_h
    prompts = [p + out[:16] for p, out in zip(make_prompts(8), plain(path, 8, 24))]
    spec = {"method": "ngram", "adaptive_draft_length": False, "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    outs, stats, rec, llm = run(path, prompts, max_tokens=24, spec=spec, block_size=4, max_model_len=128,
                                max_num_batched_tokens=32)
    assert_lossless(llm, prompts, plain_from(path, prompts), outs)
    assert stats["num_accepted_tokens"] > 0
    assert rec.had_ragged_step()


def test_scripted_every_acceptance_count_equals_plain(tiny_nemotron_h) -> None:
    path, _ = tiny_nemotron_h
    k = 3
    prompts = make_prompts(8, seed=1)
    ref = list(plain(path, 8, 24, 1))
    reference = {i: (len(p), out) for i, (p, out) in enumerate(zip(prompts, ref))}
    spec = {"method": "scripted", "num_speculative_tokens": k, "script": scripted(reference, k, [0, 1, 2, 3, -1])}
    outs, _, rec, _ = run(path, prompts, max_tokens=24, spec=spec, block_size=4, max_model_len=128,
                          max_num_batched_tokens=24)
    assert outs == ref
    assert {c - 1 for _, _, d, c in rec.verify_rows() if d == k} == set(range(k + 1))
    assert rec.had_ragged_step() and rec.had_mixed_step()
