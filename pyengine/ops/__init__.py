"""Paged KV-cache ops: validate once here, then dispatch by device.

CPU tensors run pyengine.ops.cpu (C++ loops of the extension, fp32/bf16) where it has the op,
else the PyTorch reference (pyengine.ops.reference, pyengine.ops.layer_reference). CUDA tensors
run pyengine.ops.cuda (same signatures) where it has the op, else the reference, so a partially
built stack still produces correct results. PYENGINE_CPU_KERNELS=0 keeps the CPU on the reference.
"""
from __future__ import annotations

import os
from types import ModuleType
from typing import Any

import torch

from pyengine.engine.attention_metadata import AttentionMetadata
from pyengine.ops import layer_reference, reference

__all__ = ["reshape_and_cache", "paged_attention", "rms_norm", "fused_add_rms_norm", "silu_and_mul",
           "rope_and_cache", "skinny_linear"]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_cuda_impl: ModuleType | None = None
_cuda_checked = False
_cpu_impl: ModuleType | None = None
_cpu_checked = False


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
    elif device.type == "cpu":
        global _cpu_impl, _cpu_checked
        if not _cpu_checked:
            _cpu_checked = True
            if cpu_kernels_enabled():
                try:
                    from pyengine.ops import cpu as cpu_ops

                    _cpu_impl = cpu_ops
                except ImportError:
                    _cpu_impl = None
        if _cpu_impl is not None:
            return _cpu_impl
    return reference


def cpu_kernels_enabled() -> bool:
    """False when PYENGINE_CPU_KERNELS=0: CPU models then run the PyTorch references and oneDNN."""
    return os.environ.get("PYENGINE_CPU_KERNELS", "1") != "0"


def _impl(device: torch.device, name: str) -> Any:
    """The backend's op `name`, or the reference's where the backend lacks it."""
    fn = getattr(_backend(device), name, None)
    if fn is None:
        fn = getattr(reference, name, None) or getattr(layer_reference, name)
    return fn


def skinny_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """x @ w (+ bias) by the backend's few-row GEMM (CUDA: hipkernels/skinny_gemm.hip) where it
    takes the call, else None: the caller runs its own GEMM."""
    fn = getattr(_backend(x.device), "skinny_linear", None)
    return None if fn is None else fn(x, w, bias)


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
    _impl(key.device, "reshape_and_cache")(key, value, k_cache, v_cache, slot_mapping)


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
    return _impl(q.device, "paged_attention")(q, k_cache, v_cache, meta, scale, return_lse=return_lse)


def _check_rows(name: str, x: torch.Tensor, width: int | None = None) -> None:
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"{name} must be [T, H] with a contiguous last dim, got {tuple(x.shape)}")
    if x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name} dtype {x.dtype} is not a float type")
    if width is not None and x.shape[1] != width:
        raise ValueError(f"{name} has width {x.shape[1]}, expected {width}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, H] -> x * rsqrt(mean(x^2) + eps) * weight, fp32 math (see layer_reference)."""
    _check_rows("x", x, weight.shape[0])
    _check_same_device(x, weight)
    return _impl(x.device, "rms_norm")(x, weight, eps)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """In place: residual <- x + residual, x <- rms_norm(residual); returns (x, residual)."""
    _check_rows("x", x, weight.shape[0])
    if residual.shape != x.shape or residual.dtype != x.dtype or not residual.is_contiguous() or not x.is_contiguous():
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} must match x {tuple(x.shape)} {x.dtype}, both contiguous")
    _check_same_device(x, residual, weight)
    return _impl(x.device, "fused_add_rms_norm")(x, residual, weight, eps)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] -> silu(x[:, :I]) * x[:, I:] as [T, I]."""
    _check_rows("x", x)
    if x.shape[1] % 2:
        raise ValueError(f"silu_and_mul needs an even width, got {x.shape[1]}")
    return _impl(x.device, "silu_and_mul")(x)


def rope_and_cache(qk: torch.Tensor, v: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Rotate q and k in place (qk [T, Hq + Hkv, D], rows may be strided; cos/sin [T, D], None = no
    rotation) and write k = qk[:, Hq:] and v [T, Hkv, D] to the paged cache by slot_mapping."""
    _check_cache("k_cache", k_cache)
    _check_cache("v_cache", v_cache)
    t, hkv, d = v.shape[0], k_cache.shape[2], k_cache.shape[3]
    if qk.dim() != 3 or qk.shape[0] != t or qk.shape[2] != d or qk.shape[1] <= hkv or qk.stride(-1) != 1:
        raise ValueError(f"qk must be [T, Hq + Hkv, D] with D = {d} contiguous, got {tuple(qk.shape)}")
    if tuple(v.shape) != (t, hkv, d) or v.stride(-1) != 1:
        raise ValueError(f"v must be [T, Hkv, D] = {(t, hkv, d)}, got {tuple(v.shape)}")
    if (cos is None) != (sin is None) or (cos is not None and (tuple(cos.shape) != (t, d) or cos.shape != sin.shape)):
        raise ValueError(f"cos and sin must both be [T, D] = {(t, d)} or both None")
    if slot_mapping.dtype != torch.int64 or tuple(slot_mapping.shape) != (t,):
        raise ValueError(f"slot_mapping must be int64 [T] = [{t}]")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ")
    _check_same_device(qk, v, k_cache, v_cache, slot_mapping)
    _impl(qk.device, "rope_and_cache")(qk, v, cos, sin, k_cache, v_cache, slot_mapping)
