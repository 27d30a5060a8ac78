"""Pure-PyTorch per-token layer ops: the executable spec of the fused CPU and GPU versions.

Every op does its arithmetic in float32 and rounds once to the tensor dtype on store, so fp32
models are unchanged by fusion and bf16/fp16 models round once per op (not once per torch op).
Each token is computed on its own: results never depend on what else is in the batch.

  rms_norm(x, w)                   out = x * rsqrt(mean(x^2) + eps) * w
  fused_add_rms_norm(x, res, w)    in place: res <- x + res (rounded to dtype), x <- rms_norm(res, w)
  silu_and_mul(x)                  [T, 2I] -> [T, I]: silu(x[:, :I]) * x[:, I:]
  rope_and_cache(qk, v, cos, sin)  in place: qk <- qk * cos + rotate(qk) * sin (rotate swaps the two
                                   halves of head_dim, the negation lives in sin's first half); then
                                   k = qk[:, Hq:] and v are written to the paged cache by slot_mapping
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pyengine.ops.reference.attention import reshape_and_cache


def _rms(xf: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps) * weight.float()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _rms(x.float(), weight, eps).to(x.dtype)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    residual.add_(x)  # one rounding for half types: torch adds in fp32
    x.copy_(_rms(residual.float(), weight, eps))
    return x, residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    inter = x.shape[-1] // 2
    xf = x.float()
    return (F.silu(xf[..., :inter]) * xf[..., inter:]).to(x.dtype)


def rope_and_cache(qk: torch.Tensor, v: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    num_kv_heads = v.shape[1]
    if cos is not None and sin is not None:
        half = qk.shape[-1] // 2
        xf = qk.float()
        rotated = torch.cat((xf[..., half:], xf[..., :half]), dim=-1)
        qk.copy_(xf * cos.float()[:, None, :] + rotated * sin.float()[:, None, :])
    reshape_and_cache(qk[:, qk.shape[1] - num_kv_heads:], v, k_cache, v_cache, slot_mapping)
