"""Bamba (Mamba2 + attention hybrid) on CPU: HF transformers' logits and greedy tokens on a tiny random
model (attention layers with partial RoPE and GQA between Mamba2 layers), and lossless speculative
decoding through the engine's paged KV cache + recurrent-state pool together."""
from __future__ import annotations

import pytest
import torch
import transformers

from pyengine.loader import load_model
from pyengine.models.bamba import rope_permutation
from tests.hybrid_spec_checks import (SCRIPTED_CASES, check_greedy_matches_hf_generate, check_ngram_ragged, check_scripted,
                                       make_hybrid_checkpoint, state_pool_llm)
from tests.tiny_models import VOCAB
from tests.utils_paged import PagedCache, make_meta

# 4 layers: mamba, attention, mamba, attention (attention first and last is covered by the pattern test).
BAMBA = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, attn_layer_indices=[1, 3], mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=2,
             mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8, max_position_embeddings=256,
             tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def make_bamba_checkpoint(path: str, seed: int = 0, **overrides) -> torch.nn.Module:
    return make_hybrid_checkpoint(path, transformers.BambaForCausalLM, transformers.BambaConfig(**{**BAMBA, **overrides}),
                                  seed, ("out_proj.weight", "o_proj.weight", "down_proj.weight"), out_std=0.02)


@pytest.fixture(scope="module")
def tiny_bamba(tmp_path_factory) -> tuple[str, torch.nn.Module]:
    path = str(tmp_path_factory.mktemp("tiny_bamba"))
    return path, make_bamba_checkpoint(path)


def test_rope_permutation_pairs() -> None:
    for d, r in [(16, 8), (16, 16), (64, 32), (8, 2)]:
        perm = rope_permutation(d, r).tolist()
        assert sorted(perm) == list(range(d))
        for j in range(r // 2):  # HF's rotate_half pair (j, j + r/2) sits at our (j, j + d/2)
            assert (perm[j], perm[j + d // 2]) == (j, j + r // 2)


SEQS = [[5, 9, 33, 2, 71, 14, 14, 8, 60, 3, 17, 40, 41, 90, 11, 7, 23, 5, 9, 33], [4], list(range(10, 29))]


@torch.inference_mode()
def forward_logits(path: str, seqs: list[list[int]]) -> tuple[torch.Tensor, object]:
    model, config, _ = load_model(path, "cpu", torch.float32)
    cache = PagedCache(config, 32, 4, torch.float32)  # NaN-filled, shuffled blocks
    rows = []
    for s in seqs:
        table: list[int] = []
        cache.grow(table, len(s))
        rows.append((table, 0, len(s)))
    meta, pos = make_meta(rows, 4)
    flat = torch.tensor([t for s in seqs for t in s])
    return model.compute_logits(model(flat, pos, meta, cache.kv_caches)), config


@torch.inference_mode()
def test_logits_match_hf(tiny_bamba) -> None:
    path, hf = tiny_bamba
    ours, config = forward_logits(path, SEQS)  # rows of > chunk_size tokens: SSM chunks cross
    assert config.architecture == "BambaForCausalLM" and config.attn_layer_indices == (1, 3)
    assert config.rotary_dim == 8  # partial_rotary_factor 0.5 of head_dim 16
    want = torch.cat([hf(torch.tensor([s])).logits[0] for s in SEQS])
    torch.testing.assert_close(ours, want, atol=1e-4, rtol=1e-4)


@torch.inference_mode()
@pytest.mark.parametrize("attn", [[0], [0, 1, 2]])
def test_logits_match_hf_layer_patterns(tmp_path, attn: list[int]) -> None:
    """Attention first / consecutive attention layers / a trailing Mamba layer; tied embeddings."""
    hf = make_bamba_checkpoint(str(tmp_path), seed=3, attn_layer_indices=attn, tie_word_embeddings=len(attn) == 1)
    ours, _ = forward_logits(str(tmp_path), SEQS[:2])
    want = torch.cat([hf(torch.tensor([s])).logits[0] for s in SEQS[:2]])
    torch.testing.assert_close(ours, want, atol=1e-4, rtol=1e-4)


def test_greedy_tokens_match_hf_generate(tiny_bamba) -> None:
    check_greedy_matches_hf_generate(*tiny_bamba)


def test_state_pool_only_for_mamba_layers(tiny_bamba) -> None:
    llm, cache = state_pool_llm(tiny_bamba[0])
    assert cache.conv[1] is None and cache.ssm[3] is None  # attention layers
    assert cache.conv[0].shape == (24, 4 - 1 + 3, 128 + 2 * 2 * 16) and cache.ssm[2].shape == (24, 8, 16, 16)
    # The runner allocates KV for every layer (the Mamba layers' pairs are unused): see bamba.py.
    assert len(llm.engine.runner.kv_caches) == 4 and llm.engine.runner.kv_caches[1][0].shape[2:] == (2, 16)


def test_ngram_greedy_equals_plain_batch8_ragged(tiny_bamba) -> None:
    check_ngram_ragged(tiny_bamba[0])


@pytest.mark.parametrize("name,pattern,budget", SCRIPTED_CASES)
def test_scripted_equals_plain(tiny_bamba, name: str, pattern: list[int], budget: int) -> None:
    check_scripted(tiny_bamba[0], name, pattern, budget)
