"""GGUF file (llama.cpp format) -> model, config and tokenizer, through pyengine's reader
(gguf_reader.py: a memory map of the file).

Quantised tensors (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K, ...) are dequantised to float32 at load time
(gguf_dequant.py) and then cast to the requested dtype: the engine runs dense weights, or on the
CPU packs them (Q4_0 / Q4_1 / Q8_0 values back into their codes: see ops.cpu.PackedLinear). One
tensor is dense at a time: each is made in the layout of its parameter, which takes it over, and
on the CPU each linear is packed as soon as it is complete (LlamaForCausalLM.load_weights).
"""
from __future__ import annotations

from collections.abc import Callable, Collection, Iterator
from typing import Any

import numpy as np
import torch
from torch import nn

from pyengine.config import ModelConfig
from pyengine.loader.gguf_codes import pack_from_codes, rows_of
from pyengine.loader.gguf_dequant import decode, dequantize
from pyengine.loader.gguf_reader import GGUFFile, GGUFTensor
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


def _open(path: str) -> GGUFFile:
    """The parsed file (metadata and tensor records); a one-line ValueError if it is malformed."""
    return GGUFFile(path)


def read_fields(reader: GGUFFile) -> dict[str, Any]:
    """All metadata as plain Python values (strings, numbers, lists)."""
    return dict(reader.fields)


def _unpermute_rope(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter reorders each head's Q/K rows from HF rotate-half (first half, second
    half) to interleaved pairs; this undoes it: rows [h, pair, 2] -> [h, 2, pair]."""
    rows = w.shape[0]
    half = rows // num_heads // 2
    return np.ascontiguousarray(w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2)).reshape(w.shape)


def config_from_fields(fields: dict[str, Any], tensor_names: set[str]) -> ModelConfig:
    arch = fields.get("general.architecture")
    if arch not in _ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(sorted(_ARCHITECTURES))}")

    def get(key: str, default: Any = None) -> Any:
        return fields.get(f"{arch}.{key}", default)

    def need_int(key: str, default: Any = None) -> int:
        value = get(key, default)
        if isinstance(value, list) and len(value) == 1:
            value = value[0]
        if value is None:
            raise ValueError(f"GGUF metadata has no {arch}.{key}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
            raise ValueError(f"GGUF metadata {arch}.{key} must be an integer, got {value!r}")
        return int(value)

    tokens = fields.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        raise ValueError("GGUF metadata has no tokenizer.ggml.tokens (the vocabulary)")
    num_heads = need_int("attention.head_count")
    hidden = need_int("embedding_length")
    if num_heads <= 0:
        raise ValueError(f"GGUF metadata {arch}.attention.head_count must be positive, got {num_heads}")
    cfg: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[arch]],
        "vocab_size": need_int("vocab_size", len(tokens)),
        "hidden_size": hidden,
        "intermediate_size": need_int("feed_forward_length"),
        "num_hidden_layers": need_int("block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": need_int("attention.head_count_kv", num_heads),
        "head_dim": need_int("attention.key_length", hidden // num_heads),
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


def hf_name_of(name: str, config: ModelConfig) -> str | None:
    """The HF name of a GGUF tensor; None for one the model does not load."""
    if name == "rope_freqs.weight":
        return None  # consumed by the config (llama3 frequency factors)
    if name in _GLOBAL_NAMES:
        hf_name = _GLOBAL_NAMES[name]
        return None if hf_name == "lm_head.weight" and config.tie_word_embeddings else hf_name
    parts = name.split(".")
    if len(parts) != 4 or parts[0] != "blk" or parts[2] not in _LAYER_NAMES or not parts[1].isdigit():
        raise ValueError(f"unexpected GGUF tensor {name}")
    if int(parts[1]) >= config.num_hidden_layers:
        raise ValueError(f"GGUF tensor {name} is for layer {int(parts[1])}, but the model has "
                         f"{config.num_hidden_layers} layers (block_count)")
    return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"


def iter_gguf_weights(reader: GGUFFile, config: ModelConfig, dtype: torch.dtype,
                      skip: Collection[str] = ()) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) of every weight, each a new tensor the consumer may keep. A matrix comes
    as the transposed view of an [in, out] array (the layout of the model's linears and of a tied
    lm_head), except an untied embedding, which the model keeps row-major. The embedding and
    output come first: they are the largest, and the model packs them and drops their dense
    copies before the layers arrive. skip: GGUF names to leave out (packed from their codes)."""
    order = sorted(reader.tensors, key=lambda t: t.name not in _GLOBAL_NAMES)
    for tensor in order:
        hf_name = hf_name_of(tensor.name, config)
        if hf_name is not None and tensor.name not in skip:
            yield hf_name, _weight(reader, tensor, hf_name, config).to(dtype)


def _row_order(tensor: GGUFTensor, config: ModelConfig) -> Callable[[np.ndarray], np.ndarray]:
    """How the tensor's rows (axis 0 of any array over them) go into HF's order."""
    kind = tensor.name.split(".")[-2]
    heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
    if config.architecture == "LlamaForCausalLM" and kind in heads:  # qwen2/qwen3 files keep HF's layout
        return lambda a: _unpermute_rope(a, heads[kind])
    return lambda a: a


def _weight(reader: GGUFFile, tensor: GGUFTensor, hf_name: str, config: ModelConfig) -> torch.Tensor:
    shape = tensor.shape
    rows, cols = int(np.prod(shape[:-1], dtype=np.int64)), shape[-1]
    blocks = decode(reader.data(tensor), tensor.ggml_type, rows, cols).map_rows(_row_order(tensor, config))
    if len(shape) == 2 and (hf_name != "model.embed_tokens.weight" or config.tie_word_embeddings):
        w = torch.from_numpy(blocks.to_float(transposed=True)).t()
    else:
        w = torch.from_numpy(blocks.to_float()).reshape(shape)
    del blocks  # views of the map
    reader.release(tensor.offset, tensor.offset + tensor.nbytes)
    return w


def load_gguf(path: str, dtype: torch.dtype, prepack_cpu: bool = False,
              from_codes: bool = True) -> tuple[nn.Module, ModelConfig, Tokenizer]:
    """prepack_cpu: pack the linears for the CPU while loading (see LlamaForCausalLM.load_weights);
    the caller then runs prepack_for_cpu. from_codes (with prepack_cpu): pack Q4_0 / Q4_1 / Q8_0
    linears straight from the file's codes (gguf_codes.py; the same packed weights, no float32
    copy); False dequantises them first, as every other type is."""
    with _open(path) as reader:
        fields = read_fields(reader)
        tensor_names = {t.name for t in reader.tensors}
        try:
            config = config_from_fields(fields, tensor_names)
            config.validate()
            if "rope_freqs.weight" in tensor_names:
                # Llama 3.1+ files store the llama3 scaling as precomputed per-frequency divisors.
                freqs = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
                factors = dequantize(reader.data(freqs), freqs.ggml_type, freqs.shape).reshape(-1).tolist()
                config.rope_scaling = {"rope_type": "freq_factors", "factors": factors}
            tokenizer = Tokenizer.from_gguf_fields(fields)
        except Exception as exc:  # KeyError/IndexError/TypeError of odd metadata too: one line naming the file
            msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            if isinstance(exc, KeyError):
                msg = f"GGUF metadata has no {exc.args[0]!r}"
            raise ValueError(f"{path}: {msg}") from None
        del fields
        reader.fields.clear()  # the vocabulary's ~100k strings: the tokenizer holds its own
        config.eos_token_ids = list(dict.fromkeys(config.eos_token_ids + tokenizer.eos_token_ids))
        tokenizer.eos_token_ids = config.eos_token_ids
        model = build_model(config, dtype)
        try:
            packed: set[str] = set()
            if prepack_cpu and from_codes:
                packed = pack_from_codes(model, reader, config, lambda t: rows_of(reader, t, _row_order(t, config)))
            model.load_weights(iter_gguf_weights(reader, config, dtype, skip=packed), adopt=True,  # type: ignore[operator]
                               prepack_cpu=prepack_cpu)
        except ValueError as exc:
            raise ValueError(f"{path}: {str(exc).splitlines()[0]}") from None
    return model, config, tokenizer
