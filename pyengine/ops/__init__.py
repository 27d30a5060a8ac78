"""Paged KV-cache ops: validate once here, then dispatch by device.

CPU tensors run the PyTorch reference (pyengine.ops.reference). CUDA tensors run
pyengine.ops.cuda (same signatures) when it imports, else fall back to the reference so a
partially built GPU stack still produces correct results.
"""
from __future__ import annotations

from types import ModuleType

import torch

from pyengine.attention_metadata import AttentionMetadata
from pyengine.ops import reference

__all__ = ["reshape_and_cache", "paged_attention"]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_cuda_impl: ModuleType | None = None
_cuda_checked = False


def _backend(device: torch.device) -> ModuleType:
    # ---- CUDA dispatch point: pyengine.ops.cuda provides reshape_and_cache / paged_attention ----
    global _cuda_impl, _cuda_checked
    if device.type == "cuda":
        if not _cuda_checked:
            _cuda_checked = True
            try:
                from pyengine.ops import cuda as cuda_ops  # written by the GPU engineer

                _cuda_impl = cuda_ops
            except ImportError:
                _cuda_impl = None
        if _cuda_impl is not None:
            return _cuda_impl
    return reference


def _check_cache(name: str, cache: torch.Tensor) -> None:
    if cache.dim() != 4:
        raise ValueError(f"{name} must be [num_blocks, block_size, num_kv_heads, head_dim], got {tuple(cache.shape)}")
    if cache.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name} dtype {cache.dtype} is not a float type")
    if not cache.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def _check_same_device(*tensors: torch.Tensor) -> None:
    device = tensors[0].device
    for t in tensors[1:]:
        if t.device != device:
            raise ValueError(f"all tensors must be on one device, got {device} and {t.device}")


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write key/value [T, Hkv, D] into the paged caches at slot_mapping [T] (int64, -1 = skip)."""
    _check_cache("k_cache", k_cache)
    _check_cache("v_cache", v_cache)
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ")
    expected = (slot_mapping.shape[0] if slot_mapping.dim() == 1 else -1, k_cache.shape[2], k_cache.shape[3])
    if key.dim() != 3 or tuple(key.shape) != expected or key.shape != value.shape:
        raise ValueError(f"key/value must be [T, Hkv, D] = {expected}, got {tuple(key.shape)} / {tuple(value.shape)}")
    if slot_mapping.dtype != torch.int64:
        raise ValueError(f"slot_mapping must be int64, got {slot_mapping.dtype}")
    _check_same_device(key, value, k_cache, v_cache, slot_mapping)
    _backend(key.device).reshape_and_cache(key, value, k_cache, v_cache, slot_mapping)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Causal varlen attention of q [T, Hq, D] over the paged cache; see AttentionMetadata."""
    _check_cache("k_cache", k_cache)
    _check_cache("v_cache", v_cache)
    if q.dim() != 3:
        raise ValueError(f"q must be [T, Hq, D], got {tuple(q.shape)}")
    if q.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"q dtype {q.dtype} is not a float type")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ")
    if q.shape[2] != k_cache.shape[3]:
        raise ValueError(f"head_dim mismatch: q has {q.shape[2]}, cache has {k_cache.shape[3]}")
    if q.shape[1] % k_cache.shape[2] != 0:
        raise ValueError(f"num_heads {q.shape[1]} is not a multiple of num_kv_heads {k_cache.shape[2]}")
    if k_cache.shape[1] != meta.block_size:
        raise ValueError(f"cache block_size {k_cache.shape[1]} != meta.block_size {meta.block_size}")
    if q.shape[0] != meta.num_tokens:
        raise ValueError(f"q has {q.shape[0]} tokens but meta.slot_mapping has {meta.num_tokens}")
    if meta.query_start_loc.shape[0] != meta.num_rows + 1 or meta.block_tables.shape[0] != meta.num_rows:
        raise ValueError("meta.query_start_loc must be [R+1] and meta.block_tables [R, max_blocks]")
    _check_same_device(q, k_cache, v_cache, meta.block_tables, meta.context_lens, meta.query_start_loc)
    return _backend(q.device).paged_attention(q, k_cache, v_cache, meta, scale, return_lse=return_lse)
