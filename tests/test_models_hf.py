"""Tiny random HF checkpoints (safetensors): pyengine logits and greedy tokens == transformers."""
from __future__ import annotations

import json

import pytest
import torch

from pyengine.loader import load_model
from tests.tiny_models import _COMMON, CASES, VOCAB, make_checkpoint
from tests.utils_paged import greedy_generate, make_meta

@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(request.param))
    hf = make_checkpoint(request.param, path)
    model, config, tokenizer = load_model(path, "cpu", torch.float32)
    return request.param, hf, model, config, tokenizer


PROMPT = [5, 17, 3, 88, 41, 41, 9, 60, 2, 33, 71, 12, 7, 50, 29, 94, 18, 3, 66, 40, 21]


def _hf_greedy(hf, prompt: list[int], steps: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(ids, max_new_tokens=steps, do_sample=False, eos_token_id=None, pad_token_id=0,
                          min_new_tokens=0)
    return out[0, len(prompt):].tolist()


def test_prefill_logits_match(pair):
    case, hf, model, config, _ = pair
    block_size = 4
    shape = (16, block_size, config.num_key_value_heads, config.head_dim)
    kv = [(torch.full(shape, float("nan")), torch.full(shape, float("nan"))) for _ in range(config.num_hidden_layers)]
    meta, positions = make_meta([([7, 2, 11, 0, 5, 3], 0, len(PROMPT))], block_size)
    hidden = model(torch.tensor(PROMPT), positions, meta, kv)
    logits = model.compute_logits(hidden)
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0].float()
    assert logits.dtype == torch.float32 and logits.shape == (len(PROMPT), VOCAB)
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("block_size,chunk", [(16, None), (1, None), (4, 5)])
def test_greedy_matches_hf(pair, block_size, chunk):
    case, hf, model, config, _ = pair
    prompts = [PROMPT, PROMPT[3:9], [4]]
    ours, _ = greedy_generate(model, config, prompts, 16, block_size=block_size, prefill_chunk=chunk)
    for prompt, got in zip(prompts, ours):
        assert got == _hf_greedy(hf, prompt, 16), case


def test_config_fields(pair):
    case, _, model, config, tokenizer = pair
    assert config.attention_bias == (case == "qwen2_bias")
    assert config.qk_norm == (case == "qwen3_qk_norm")
    assert (config.rope_scaling or {}).get("rope_type") == ("llama3" if "llama3" in case else None)
    assert config.tie_word_embeddings == (case in ("llama3_rope_tied", "qwen3_qk_norm"))
    assert 2 in tokenizer.eos_token_ids
    assert tokenizer.encode("t5 t17 t3") == [5, 17, 3]


def test_refuses_pickle_only_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], **_COMMON}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"not really a pickle")
    with pytest.raises(ValueError, match="pickle"):
        load_model(str(tmp_path), "cpu", torch.float32)


def test_unknown_architecture_and_missing_path(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["FooForCausalLM"], **_COMMON}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="FooForCausalLM.*LlamaForCausalLM"):
        load_model(str(tmp_path), "cpu", torch.float32)
    with pytest.raises(ValueError, match="model file not found"):
        load_model(str(tmp_path / "nope.gguf"), "cpu", torch.float32)


def test_registry_and_config_layering():
    """Each family's architecture names resolve through the registry, and pyengine.config, which the
    models import, imports no model (no cycle)."""
    import subprocess
    import sys

    from pyengine.models import model_config_from_hf, supported_architectures

    assert supported_architectures() == ["BambaForCausalLM", "DeepseekV3ForCausalLM", "LlamaForCausalLM", "Mamba2ForCausalLM",
                                         "NemotronHForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3NextForCausalLM",
                                         "Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForCausalLM",
                                         "Qwen3_5MoeForConditionalGeneration"]
    with pytest.raises(ValueError, match="no 'architectures'"):
        model_config_from_hf(dict(_COMMON))
    code = "import sys, pyengine.config; print(sorted(m for m in sys.modules if m.startswith('pyengine.models')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
