"""GGUF file (llama.cpp format) -> model, config and tokenizer, through the `gguf` package.

Quantised tensors (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K, ...) are dequantised to float32 at load time and
then cast to the requested dtype: the engine runs dense weights.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch import nn

from pyengine.config import ModelConfig
from pyengine.models import build_model, model_config_from_hf
from pyengine.tokenizer import Tokenizer

_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

# GGUF per-layer tensor name -> HF module path inside model.layers.N
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}


def _open(path: str) -> Any:
    import gguf

    try:
        return gguf.GGUFReader(path, "r")
    except Exception as exc:  # the reader raises assorted errors on garbage; report one line
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ValueError(f"not a valid GGUF file: {path} ({msg})") from None


def read_fields(reader: Any) -> dict[str, Any]:
    """All metadata as plain Python values (strings, numbers, lists)."""
    out: dict[str, Any] = {}
    for key, field in reader.fields.items():
        try:
            out[key] = field.contents()
        except Exception:  # an odd field type we never need must not block loading
            continue
    return out


def _unpermute_rope(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp's converter reorders each head's Q/K rows from HF rotate-half (first half, second
    half) to interleaved pairs; this undoes it: rows [h, pair, 2] -> [h, 2, pair]."""
    rows = w.shape[0]
    half = rows // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def config_from_fields(fields: dict[str, Any], tensor_names: set[str]) -> ModelConfig:
    arch = fields.get("general.architecture")
    if arch not in _ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(sorted(_ARCHITECTURES))}")

    def get(key: str, default: Any = None) -> Any:
        return fields.get(f"{arch}.{key}", default)

    num_heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    vocab = get("vocab_size") or len(fields["tokenizer.ggml.tokens"])
    cfg: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[arch]],
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(get("attention.head_count_kv", num_heads)),
        "head_dim": int(get("attention.key_length") or hidden // num_heads),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "bos_token_id": fields.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": fields.get("tokenizer.ggml.eos_token_id"),
    }
    if get("rope.scaling.type") == "linear" and get("rope.scaling.factor"):
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
    return model_config_from_hf(cfg)


def _dequantize(tensor: Any) -> torch.Tensor:
    from gguf.quants import dequantize

    data = dequantize(tensor.data, tensor.tensor_type)
    shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists dims innermost first
    # np.array copies: F32 tensors are read-only views of the memory-mapped file.
    return torch.from_numpy(np.array(data, dtype=np.float32).reshape(shape))


def iter_gguf_weights(reader: Any, config: ModelConfig, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    permute = config.architecture == "LlamaForCausalLM"  # qwen2/qwen3 files keep HF's layout
    for tensor in reader.tensors:
        name = tensor.name
        if name == "rope_freqs.weight":
            continue  # consumed by the config (llama3 frequency factors)
        if name in _GLOBAL_NAMES:
            hf_name = _GLOBAL_NAMES[name]
            if hf_name == "lm_head.weight" and config.tie_word_embeddings:
                continue
        else:
            parts = name.split(".")
            if len(parts) != 4 or parts[0] != "blk" or parts[2] not in _LAYER_NAMES:
                raise ValueError(f"unexpected GGUF tensor {name}")
            hf_name = f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
        w = _dequantize(tensor)
        if permute and name.split(".")[-2] == "attn_q":
            w = _unpermute_rope(w, config.num_attention_heads)
        elif permute and name.split(".")[-2] == "attn_k":
            w = _unpermute_rope(w, config.num_key_value_heads)
        yield hf_name, w.to(dtype)


def load_gguf(path: str, dtype: torch.dtype) -> tuple[nn.Module, ModelConfig, Tokenizer]:
    reader = _open(path)
    fields = read_fields(reader)
    tensor_names = {t.name for t in reader.tensors}
    config = config_from_fields(fields, tensor_names)
    if "rope_freqs.weight" in tensor_names:
        # Llama 3.1+ files store the llama3 scaling as precomputed per-frequency divisors.
        freqs = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
        config.rope_scaling = {"rope_type": "freq_factors", "factors": _dequantize(freqs).reshape(-1).tolist()}
    tokenizer = Tokenizer.from_gguf_fields(fields)
    config.eos_token_ids = list(dict.fromkeys(config.eos_token_ids + tokenizer.eos_token_ids))
    tokenizer.eos_token_ids = config.eos_token_ids
    model = build_model(config, dtype)
    model.load_weights(iter_gguf_weights(reader, config, dtype))  # type: ignore[operator]
    return model, config, tokenizer
