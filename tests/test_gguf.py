"""The embedded SmolLM2-135M GGUF: pyengine vs transformers loading the same file."""
from __future__ import annotations

import os

import pytest
import torch

from pyengine.loader import load_model
from tests.utils_paged import greedy_generate

TEXTS = [
    "Hello, world!",
    "  leading spaces and   runs\tof\twhitespace\n\n\nnewlines ",
    "Digits 1234567890 and 3.14159, -42, 1e10",
    "unicode: café naïve 日本語 emoji 🤖🚀 Ünïcödé ß",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "code: def f(x):\n    return x**2  # comment\n",
    "<|endoftext|>mixed<repo_name>special",
    "",
]
PROMPTS = ["The capital of France is"]


@pytest.fixture(scope="module")
def hf_tokenizer(smollm2_path):
    transformers = pytest.importorskip("transformers")
    folder, name = os.path.split(smollm2_path)
    return transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)


@pytest.fixture(scope="module")
def hf_model(smollm2_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # transformers needs it to load GGUF
    folder, name = os.path.split(smollm2_path)
    return transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()


def _hf_greedy(model, ids: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """HF greedy tokens and the logits of the first generated token (no eos stop)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=steps, do_sample=False, eos_token_id=None,
                             pad_token_id=0, return_dict_in_generate=True, output_logits=True)
    return out.sequences[0, len(ids):].tolist(), out.logits[0][0].float()


def test_config_from_metadata(smollm2_fp32):
    _, config, tokenizer = smollm2_fp32
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads, config.num_key_value_heads) == (30, 576, 9, 3)
    assert config.tie_word_embeddings and config.rope_theta == 100000.0
    assert tokenizer.vocab_size == config.vocab_size == 49152
    assert tokenizer.eos_token_ids == [2]


def test_tokenizer_matches_hf(smollm2_fp32, hf_tokenizer):
    _, _, tokenizer = smollm2_fp32
    hf_tok = hf_tokenizer
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert ids == hf_tok.encode(text, add_special_tokens=True), text
        assert tokenizer.decode(ids, skip_special_tokens=False) == text
    assert tokenizer.encode("<|im_start|>") == [1]


def test_incremental_detokenizer_multibyte(smollm2_fp32):
    _, _, tokenizer = smollm2_fp32
    text = "naïve 日本語 🤖 emoji, then ascii."
    ids = tokenizer.encode(text)
    detok = tokenizer.incremental_detokenizer()
    pieces = [detok.add(i) for i in ids]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    assert len([p for p in pieces if p]) > 3  # it actually streams


def test_chat_template(smollm2_fp32, hf_tokenizer):
    _, _, tokenizer = smollm2_fp32
    messages = [{"role": "user", "content": "What is 2+2?"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert tokenizer.has_chat_template
    assert text.endswith("<|im_start|>assistant\n") and "<|im_start|>user\nWhat is 2+2?<|im_end|>" in text
    hf_text = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == hf_text


def test_greedy_matches_hf(smollm2_fp32, hf_model):
    model, config, tokenizer = smollm2_fp32
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Name a color."}])
    prompts = [tokenizer.encode(PROMPTS[0]), tokenizer.encode(chat)]
    ours, first_logits = greedy_generate(model, config, prompts, 16, block_size=16)
    for prompt, got, logits in zip(prompts, ours, first_logits):
        ref_tokens, ref_logits = _hf_greedy(hf_model, prompt, 16)
        assert got == ref_tokens
        torch.testing.assert_close(logits, ref_logits, atol=2e-3, rtol=1e-3)


def test_default_model_streams_its_quantised_weights_compactly(smollm2_fp32):
    """The default file is Q4_1 (+ a Q8_0 embedding): on an AVX-512 CPU every fp32 linear packs
    as 4-bit codes and the tied lm_head as 8-bit (csrc/cpu/cpu_gemm_affine.h), exact by construction;
    test_greedy_matches_hf runs on those weights."""
    from pyengine.ops.cpu import PackedLinear

    model = smollm2_fp32[0]
    if not isinstance(model.lm_logits_weight, PackedLinear):
        pytest.skip("this CPU runs oneDNN, not pyengine's packed GEMM")
    bits = {getattr(layer, name).bits_per_weight for layer in model.layers
            for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")}
    assert bits == {4}
    assert model.lm_logits_weight.bits_per_weight == 8


def test_missing_and_corrupt_files(tmp_path):
    with pytest.raises(ValueError, match="model file not found"):
        load_model(str(tmp_path / "missing.gguf"), "cpu", torch.float32)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(64))
    with pytest.raises(ValueError, match="GGUF") as info:
        load_model(str(bad), "cpu", torch.float32)
    assert "\n" not in str(info.value)
    text = tmp_path / "notes.gguf"
    text.write_text("hello, not a model")
    with pytest.raises(ValueError, match="GGUF"):
        load_model(str(text), "cpu", torch.float32)
