"""Tiny random HF checkpoints (safetensors + a word-level tokenizer) for CPU tests."""
from __future__ import annotations

import json
import os

import torch
import transformers
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers

VOCAB = 96
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
               num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}

CASES = {
    "llama_gqa_untied": (transformers.LlamaConfig, dict(_COMMON, tie_word_embeddings=False)),
    "llama3_rope_tied": (transformers.LlamaConfig, dict(_COMMON, tie_word_embeddings=True, rope_parameters=LLAMA3_ROPE)),
    # head_dim 16: the CPU layer-stack path (pyengine/models/llama_cpu_stack.py) takes it.
    "llama_head_dim16": (transformers.LlamaConfig, dict(_COMMON, num_attention_heads=4, tie_word_embeddings=False)),
    "qwen2_bias": (transformers.Qwen2Config, dict(_COMMON, tie_word_embeddings=False)),
    "qwen3_qk_norm": (transformers.Qwen3Config, dict(_COMMON, head_dim=16, num_key_value_heads=4, tie_word_embeddings=True)),
}


def write_tokenizer(path: str) -> None:
    vocab = {f"t{i}": i for i in range(VOCAB)}
    tok = HFTokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "t2", "bos_token": "t1"}, f)


def make_checkpoint(case: str, path: str, seed: int = 0) -> torch.nn.Module:
    """Save a random model of `case` (and its tokenizer) to `path`; returns the HF model."""
    config_cls, kwargs = CASES[case]
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(config_cls(**kwargs), dtype=torch.float32).eval()
    with torch.no_grad():  # larger-than-init weights so logits are well separated for greedy
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
    hf.save_pretrained(path, safe_serialization=True)
    write_tokenizer(path)
    return hf
