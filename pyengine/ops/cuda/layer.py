"""CUDA per-token layer ops (hipkernels/layer_ops/): fill the params structs of the kernels.

The facade has validated shapes and devices. fp16/bf16/fp32 with one dtype for every tensor of a
call run the kernels; other combinations (and rope_and_cache with an odd head_dim) the reference.
"""
from __future__ import annotations

import torch

from pyengine.ops import reference
from pyengine.ops.cuda.launch import DTYPE_CODE, kernels, params, row_stride, slots, stream


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype not in DTYPE_CODE or weight.dtype != x.dtype:
        return reference.rms_norm(x, weight, eps)
    weight = weight.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    p = params(kernels.RmsNormParams, x=x.data_ptr(), weight=weight.data_ptr(), out=out.data_ptr(),
               num_tokens=x.shape[0], hidden=x.shape[1], x_stride=row_stride(x), out_stride=row_stride(out),
               eps=float(eps), dtype=DTYPE_CODE[x.dtype])
    with torch.cuda.device(x.device):
        kernels.rms_norm(p, stream(x.device))
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    if x.dtype not in DTYPE_CODE or residual.dtype != x.dtype or weight.dtype != x.dtype:
        return reference.fused_add_rms_norm(x, residual, weight, eps)
    weight = weight.contiguous()
    # In place: out aliases x.
    p = params(kernels.RmsNormParams, x=x.data_ptr(), residual=residual.data_ptr(), weight=weight.data_ptr(),
               out=x.data_ptr(), num_tokens=x.shape[0], hidden=x.shape[1], x_stride=row_stride(x),
               residual_stride=row_stride(residual), out_stride=row_stride(x), eps=float(eps), dtype=DTYPE_CODE[x.dtype])
    with torch.cuda.device(x.device):
        kernels.fused_add_rms_norm(p, stream(x.device))
    return x, residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if x.dtype not in DTYPE_CODE:
        return reference.silu_and_mul(x)
    inter = x.shape[1] // 2
    out = torch.empty(x.shape[0], inter, dtype=x.dtype, device=x.device)
    p = params(kernels.SiluAndMulParams, x=x.data_ptr(), out=out.data_ptr(), num_tokens=x.shape[0], inter=inter,
               x_stride=row_stride(x), out_stride=row_stride(out), dtype=DTYPE_CODE[x.dtype])
    with torch.cuda.device(x.device):
        kernels.silu_and_mul(p, stream(x.device))
    return out


def rope_and_cache(qk: torch.Tensor, v: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    t, hkv, d = v.shape[0], k_cache.shape[2], k_cache.shape[3]
    dtypes = {qk.dtype, v.dtype, k_cache.dtype, v_cache.dtype}
    rope = {}
    if cos is not None and sin is not None:
        cos = cos if cos.stride(-1) == 1 else cos.contiguous()
        sin = sin if sin.stride(-1) == 1 else sin.contiguous()
        dtypes |= {cos.dtype, sin.dtype}
        rope = dict(cos=cos.data_ptr(), sin=sin.data_ptr(), cos_stride_token=row_stride(cos),
                    sin_stride_token=row_stride(sin))
    slot_ids = slots(slot_mapping)
    if len(dtypes) != 1 or qk.dtype not in DTYPE_CODE or (cos is not None and d % 2):
        return reference.rope_and_cache(qk, v, cos, sin, k_cache, v_cache, slot_mapping)
    if t == 0:
        return
    p = params(kernels.RopeAndCacheParams, qk=qk.data_ptr(), v=v.data_ptr(), k_cache=k_cache.data_ptr(),
               v_cache=v_cache.data_ptr(), slot_mapping=slot_ids.data_ptr(), num_tokens=t,
               num_q_heads=qk.shape[1] - hkv, num_kv_heads=hkv, head_dim=d, qk_stride_token=row_stride(qk),
               qk_stride_head=row_stride(qk, 1), v_stride_token=row_stride(v), v_stride_head=row_stride(v, 1),
               dtype=DTYPE_CODE[qk.dtype], **rope)
    with torch.cuda.device(qk.device):
        kernels.rope_and_cache(p, stream(qk.device))
