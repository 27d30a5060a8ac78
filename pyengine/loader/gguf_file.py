"""GGUF file (llama.cpp format) -> model, config and tokenizer, through the `gguf` package.

Quantised tensors (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K, ...) are dequantised to float32 at load time and
then cast to the requested dtype: the engine runs dense weights.
"""
from __future__ import annotations

import os
import struct
from collections.abc import Iterator
from typing import Any, NoReturn

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


_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUF value type -> bytes
_STRING, _ARRAY = 8, 9
_MAX_DIMS = 4  # GGML_MAX_DIMS


class _Layout:
    """A bounds-checked walk over a GGUF header (metadata and tensor infos), so that a truncated or
    corrupted file is reported by what is wrong instead of by the reader's numpy errors."""

    def __init__(self, path: str, buf: Any, size: int) -> None:
        self.path, self.buf, self.size, self.pos = path, buf, size, 0

    def fail(self, what: str) -> NoReturn:
        raise ValueError(f"not a valid GGUF file: {self.path} ({what})")

    def take(self, n: int, what: str) -> bytes:
        if n < 0 or self.pos + n > self.size:
            self.fail(f"{what} at byte {self.pos} runs past the end of the file ({self.size} bytes): truncated or corrupt")
        out = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return out

    def u32(self, what: str) -> int:
        return int.from_bytes(self.take(4, what), "little")

    def u64(self, what: str) -> int:
        return int.from_bytes(self.take(8, what), "little")

    def string(self, what: str) -> str:
        raw = self.take(self.u64(f"{what} length"), what)
        return raw.decode("utf-8", errors="replace")

    def value(self, vtype: int, key: str) -> Any:
        if vtype == _STRING:
            return self.string(f"metadata {key!r} string")
        if vtype == _ARRAY:
            etype = self.u32(f"metadata {key!r} array type")
            count = self.u64(f"metadata {key!r} array length")
            if etype in _SCALAR_SIZES:
                self.take(count * _SCALAR_SIZES[etype], f"metadata {key!r} array of {count}")
                return None
            if etype != _STRING:
                self.fail(f"metadata {key!r}: unknown array element type {etype}")
            if count > self.size - self.pos:
                self.fail(f"metadata {key!r}: array of {count} strings cannot fit in the file")
            pos, size, unpack = self.pos, self.size, struct.Struct("<Q").unpack_from
            for _ in range(count):  # the hot loop (a vocabulary): no copies
                if pos + 8 > size:
                    break
                pos += 8 + unpack(self.buf, pos)[0]
                if pos > size:
                    break
            else:
                self.pos = pos
                return None
            self.pos = min(pos, size)
            self.fail(f"metadata {key!r} string array runs past the end of the file ({size} bytes): truncated or corrupt")
        if vtype not in _SCALAR_SIZES:
            self.fail(f"metadata {key!r}: unknown value type {vtype}")
        raw = self.take(_SCALAR_SIZES[vtype], f"metadata {key!r} value")
        return int.from_bytes(raw, "little") if vtype in (4, 10) else None


def check_gguf_layout(path: str) -> None:
    """Raise a one-line ValueError naming what is wrong with a GGUF file's structure: its magic and
    version, metadata or tensor infos running past the end, absurd counts, unknown types, and
    tensor data that lies past the end of the file."""
    import mmap

    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        f = open(path, "rb")
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror or e}") from None
    with f:
        size = os.fstat(f.fileno()).st_size
        if size < 24:
            raise ValueError(f"not a valid GGUF file: {path} (only {size} bytes)")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            r = _Layout(path, buf, size)
            if r.take(4, "magic") != b"GGUF":
                r.fail("no GGUF magic number")
            version = r.u32("version")
            if version not in (2, 3):
                r.fail(f"unsupported GGUF version {version}")
            n_tensors, n_kv = r.u64("tensor count"), r.u64("metadata count")
            if n_tensors > size or n_kv > size:
                r.fail(f"the header claims {n_tensors} tensors and {n_kv} metadata entries, more than a {size}-byte file can hold (truncated?)")
            alignment = 32
            for i in range(n_kv):
                key = r.string(f"metadata key {i}")
                value = r.value(r.u32(f"metadata {key!r} type"), key)
                if key == "general.alignment" and value is not None:
                    alignment = value
            if alignment <= 0 or alignment & (alignment - 1):
                r.fail(f"general.alignment {alignment} is not a power of two")
            infos = []
            for i in range(n_tensors):
                name = r.string(f"tensor {i} name")
                n_dims = r.u32(f"tensor {name!r} rank")
                if not 1 <= n_dims <= _MAX_DIMS:
                    r.fail(f"tensor {name!r} has rank {n_dims} (1..{_MAX_DIMS})")
                dims = [r.u64(f"tensor {name!r} shape") for _ in range(n_dims)]
                qtype = r.u32(f"tensor {name!r} type")
                offset = r.u64(f"tensor {name!r} data offset")
                try:
                    block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
                except (ValueError, KeyError):
                    r.fail(f"tensor {name!r} has unknown data type {qtype}")
                n = 1
                for d in dims:
                    n *= d
                if dims[0] % block:
                    r.fail(f"tensor {name!r}: row length {dims[0]} is not a multiple of its type's block size {block}")
                infos.append((name, offset, n // block * type_size))
            start = -(-r.pos // alignment) * alignment
            for name, offset, nbytes in infos:
                if start + offset + nbytes > size:
                    r.fail(f"tensor {name!r} data offset past end of file: bytes {start + offset}..{start + offset + nbytes} "
                           f"of a {size}-byte file (truncated?)")


def _open(path: str) -> Any:
    import gguf

    check_gguf_layout(path)
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
            if len(parts) != 4 or parts[0] != "blk" or parts[2] not in _LAYER_NAMES or not parts[1].isdigit():
                raise ValueError(f"unexpected GGUF tensor {name}")
            if int(parts[1]) >= config.num_hidden_layers:
                raise ValueError(f"GGUF tensor {name} is for layer {int(parts[1])}, but the model has "
                                 f"{config.num_hidden_layers} layers (block_count)")
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
    try:
        config = config_from_fields(fields, tensor_names)
        config.validate()
        if "rope_freqs.weight" in tensor_names:
            # Llama 3.1+ files store the llama3 scaling as precomputed per-frequency divisors.
            freqs = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
            config.rope_scaling = {"rope_type": "freq_factors", "factors": _dequantize(freqs).reshape(-1).tolist()}
        tokenizer = Tokenizer.from_gguf_fields(fields)
    except Exception as exc:  # KeyError/IndexError/TypeError of odd metadata too: one line naming the file
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if isinstance(exc, KeyError):
            msg = f"GGUF metadata has no {exc.args[0]!r}"
        raise ValueError(f"{path}: {msg}") from None
    config.eos_token_ids = list(dict.fromkeys(config.eos_token_ids + tokenizer.eos_token_ids))
    tokenizer.eos_token_ids = config.eos_token_ids
    model = build_model(config, dtype)
    try:
        model.load_weights(iter_gguf_weights(reader, config, dtype))  # type: ignore[operator]
    except ValueError as exc:
        raise ValueError(f"{path}: {str(exc).splitlines()[0]}") from None
    return model, config, tokenizer
