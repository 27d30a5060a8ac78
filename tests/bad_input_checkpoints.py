"""Tiny broken and unbroken model checkpoints for the bad-input tests (test_bad_input.py,
test_bad_model_files.py): a random Llama in HF layout written directly (no transformers import), and
the mutations a test applies to a copy of it."""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers

VOCAB = 96
CONFIG = dict(architectures=["LlamaForCausalLM"], vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False, eos_token_id=2,
              bos_token_id=1)
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} {% endfor %}"


def write_checkpoint(path: Path, vocab: int = VOCAB, token_prefix: str = "t") -> None:
    """A tiny random Llama in HF layout: config.json, model.safetensors, tokenizer files."""
    path.mkdir(parents=True)
    cfg = dict(CONFIG, vocab_size=vocab)
    (path / "config.json").write_text(json.dumps(cfg))
    h, inter, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    hq, hkv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    g = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.1

    tensors = {"model.embed_tokens.weight": rand(vocab, h), "model.norm.weight": torch.ones(h),
               "lm_head.weight": rand(vocab, h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors.update({p + "input_layernorm.weight": torch.ones(h), p + "post_attention_layernorm.weight": torch.ones(h),
                        p + "self_attn.q_proj.weight": rand(hq, h), p + "self_attn.k_proj.weight": rand(hkv, h),
                        p + "self_attn.v_proj.weight": rand(hkv, h), p + "self_attn.o_proj.weight": rand(h, hq),
                        p + "mlp.gate_proj.weight": rand(inter, h), p + "mlp.up_proj.weight": rand(inter, h),
                        p + "mlp.down_proj.weight": rand(h, inter)})
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    tok = HFTokenizer(models.WordLevel(vocab={f"{token_prefix}{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "t2", "bos_token": "t1",
                                                            "chat_template": CHAT_TEMPLATE}))


def with_config(**changes: object) -> Callable[[Path], None]:
    def mutate(d: Path) -> None:
        cfg = json.loads((d / "config.json").read_text())
        for k, v in changes.items():
            if v is None:
                cfg.pop(k)
            else:
                cfg[k] = v
        (d / "config.json").write_text(json.dumps(cfg))
    return mutate


def with_file(name: str, data: bytes | str) -> Callable[[Path], None]:
    def mutate(d: Path) -> None:
        (d / name).write_bytes(data if isinstance(data, bytes) else data.encode())
    return mutate
