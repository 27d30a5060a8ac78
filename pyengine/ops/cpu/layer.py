"""CPU per-token layer ops (csrc/cpu/cpu_layer_ops.cpp) for fp32 and bf16 tensors; any other dtype,
or a layout the loops do not take, runs the reference."""
from __future__ import annotations

import torch

from pyengine.ops import reference
from pyengine.ops.cpu.extension import DTYPE_CODE, heads_contiguous, kernels, pool_threads, raise_error


def rope_and_cache(qk: torch.Tensor, v: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    code = DTYPE_CODE.get(qk.dtype)
    if (code is None or not (k_cache.dtype == v_cache.dtype == v.dtype == qk.dtype)
            or not heads_contiguous(qk) or not heads_contiguous(v)):
        return reference.rope_and_cache(qk, v, cos, sin, k_cache, v_cache, slot_mapping)
    if cos is not None and sin is not None:
        cos = cos.to(qk.dtype).contiguous()
        sin = sin.to(qk.dtype).contiguous()
    slots = slot_mapping.contiguous()
    raise_error(kernels.rope_and_cache(qk.data_ptr(), qk.stride(0), v.data_ptr(), v.stride(0),
                      0 if cos is None else cos.data_ptr(), 0 if sin is None else sin.data_ptr(),
                      k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(), k_cache.shape[0] * k_cache.shape[1], qk.shape[0],
                      qk.shape[1] - v.shape[1], v.shape[1], qk.shape[2], code, pool_threads()))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    code = DTYPE_CODE.get(x.dtype)
    if code is None or weight.dtype != x.dtype:
        return reference.rms_norm(x, weight, eps)
    x, weight = x.contiguous(), weight.contiguous()
    out = torch.empty_like(x)
    raise_error(kernels.rms_norm(x.data_ptr(), 0, out.data_ptr(), weight.data_ptr(), x.shape[0], x.shape[1], eps, code))
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    code = DTYPE_CODE.get(x.dtype)
    if code is None or weight.dtype != x.dtype:
        return reference.fused_add_rms_norm(x, residual, weight, eps)
    weight = weight.contiguous()
    raise_error(kernels.rms_norm(x.data_ptr(), residual.data_ptr(), 0, weight.data_ptr(), x.shape[0], x.shape[1], eps, code))
    return x, residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    code = DTYPE_CODE.get(x.dtype)
    if code is None:
        return reference.silu_and_mul(x)
    x = x.contiguous()
    inter = x.shape[1] // 2
    out = torch.empty(x.shape[0], inter, dtype=x.dtype)
    kernels.silu_and_mul(x.data_ptr(), out.data_ptr(), x.shape[0], inter, code, pool_threads())
    return out
