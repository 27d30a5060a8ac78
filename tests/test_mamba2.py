"""Mamba2 on CPU: HF transformers' logits and greedy tokens on a tiny random model, and lossless
speculative decoding through the engine's recurrent-state pool (every decode row on the one
speculative path; rows with and without drafts, prefill chunks and verify rows in one batch)."""
from __future__ import annotations

import math

import pytest
import torch
import transformers

from pyengine.loader import load_model
from tests.hybrid_spec_checks import (SCRIPTED_CASES, check_greedy_matches_hf_generate, check_ngram_ragged, check_scripted,
                                       make_hybrid_checkpoint, plain, state_pool_llm)
from tests.spec_harness import run
from tests.test_spec_decode import make_prompts, scripted
from tests.tiny_models import VOCAB
from tests.utils_paged import make_meta

MAMBA2 = dict(vocab_size=VOCAB, hidden_size=64, num_heads=8, head_dim=16, state_size=16, n_groups=2, conv_kernel=4,
              expand=2, num_hidden_layers=2, chunk_size=8, tie_word_embeddings=False, bos_token_id=1,
              eos_token_id=2, pad_token_id=0)


def make_mamba2_checkpoint(path: str, seed: int = 0) -> torch.nn.Module:
    return make_hybrid_checkpoint(path, transformers.Mamba2ForCausalLM, transformers.Mamba2Config(**MAMBA2), seed,
                                  ("out_proj.weight",), out_std=0.01)


@pytest.fixture(scope="module")
def tiny_mamba2(tmp_path_factory) -> tuple[str, torch.nn.Module]:
    path = str(tmp_path_factory.mktemp("tiny_mamba2"))
    return path, make_mamba2_checkpoint(path)


@torch.inference_mode()
def test_logits_match_hf(tiny_mamba2) -> None:
    path, hf = tiny_mamba2
    model, config, _ = load_model(path, "cpu", torch.float32)
    assert config.architecture == "Mamba2ForCausalLM"
    seqs = [[5, 9, 33, 2, 71, 14, 14, 8, 60, 3, 17, 40, 41, 90, 11, 7, 23, 5, 9, 33], [4], list(range(10, 29))]
    flat = torch.tensor([t for s in seqs for t in s])
    meta, pos = make_meta([([0, 1], 0, len(s)) for s in seqs], 16)  # two rows of > chunk_size tokens: chunks cross
    ours = model.compute_logits(model(flat, pos, meta, []))
    want = torch.cat([hf(torch.tensor([s])).logits[0] for s in seqs])
    torch.testing.assert_close(ours, want, atol=1e-4, rtol=1e-4)


def test_greedy_tokens_match_hf_generate(tiny_mamba2) -> None:
    check_greedy_matches_hf_generate(*tiny_mamba2)


def test_hybrid_model_gets_a_state_pool_and_checkpoints(tiny_mamba2) -> None:
    _, cache = state_pool_llm(tiny_mamba2[0])
    assert cache.conv[0].shape == (24, 4 - 1 + 3, 128 + 2 * 2 * 16) and cache.ssm[0].shape == (24, 8, 16, 16)
    assert cache.ssm[0].dtype == torch.float32




def test_ngram_greedy_equals_plain_batch8_ragged(tiny_mamba2) -> None:
    check_ngram_ragged(tiny_mamba2[0])


@pytest.mark.parametrize("name,pattern,budget", SCRIPTED_CASES)
def test_scripted_equals_plain(tiny_mamba2, name: str, pattern: list[int], budget: int) -> None:
    check_scripted(tiny_mamba2[0], name, pattern, budget)


def test_scripted_with_preemption_equals_plain(tiny_mamba2) -> None:
    path, _ = tiny_mamba2
    prompts = make_prompts(8, seed=1)
    ref = list(plain(path, 8, 24, 1))
    reference = {i: (len(p), out) for i, (p, out) in enumerate(zip(prompts, ref))}
    spec = {"method": "scripted", "num_speculative_tokens": 3, "script": scripted(reference, 3, [3, 1, -1])}
    outs, stats, _, _ = run(path, prompts, max_tokens=24, spec=spec, block_size=4, max_model_len=128,
                            num_kv_blocks=math.ceil(128 / 4) + 8)
    assert stats["num_preemptions"] > 0
    assert outs == ref
