"""CUDA recurrent-state ops of Mamba2 layers (hipkernels/ssm/ssm_state.hip): fill the params structs.

The facade has validated the shapes. Here: the kernels' own limits (ValueError), fp32 per-head
parameters (A, D, dt_bias), int32 row metadata and rows with a contiguous last dim. The chunked
prefill scan runs the selective-state kernel token after token with only the final state written
(the chunked tensor-core form is future work).
"""
from __future__ import annotations

from typing import Any

import torch

from pyengine.ops.cuda.launch import DTYPE_CODE, kernels, params, ptr, stream

MAX_TOKENS_PER_ROW = 16
MAX_STATE_SIZE = 256
MAX_CONV_WIDTH = 8


def _i32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.int32).contiguous()


def _f32(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.to(torch.float32).contiguous()


def _bool(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.to(torch.bool).contiguous()


def _rows_last_contiguous(t: torch.Tensor) -> torch.Tensor:
    inner_contig = t[0].is_contiguous() if t.shape[0] else True
    return t if inner_contig and t.stride(-1) == 1 else t.contiguous()


def _conv(launch: Any, x, conv_state, weight, bias, query_start_loc, state_idx, num_accepted, has_initial_state,
          activation, pdl: bool) -> torch.Tensor:
    if x.dtype not in DTYPE_CODE or conv_state.dtype != x.dtype or not conv_state.is_contiguous():
        raise ValueError(f"x must be fp16/bf16/fp32 and conv_state contiguous of x's dtype, got {x.dtype} / {conv_state.dtype}")
    width = weight.shape[-1]
    if not 2 <= width <= MAX_CONV_WIDTH:
        raise ValueError(f"the conv kernels take widths 2..{MAX_CONV_WIDTH}, got {width}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    w = weight.reshape(weight.shape[0], width).to(x.dtype).contiguous()
    b = None if bias is None else bias.to(x.dtype).contiguous()
    # Every temporary stays referenced until the launch: a freed block could be reused (and
    # overwritten) by the next conversion before the kernel reads it.
    idx, qsl, acc, init = _i32(state_idx), _i32(query_start_loc), _i32(num_accepted), _bool(has_initial_state)
    p = params(kernels.CausalConv1dParams, x=ptr(x), y=ptr(y), conv_state=ptr(conv_state), weight=ptr(w), bias=ptr(b),
               query_start_loc=ptr(qsl), state_idx=ptr(idx), num_accepted=ptr(acc), has_initial_state=ptr(init),
               num_rows=idx.shape[0], dim=x.shape[1], width=width, state_rows=conv_state.shape[1],
               slots_per_row=idx.shape[1], x_stride_token=x.stride(0), y_stride_token=y.stride(0),
               silu=activation in ("silu", "swish"), dtype=DTYPE_CODE[x.dtype], pdl=pdl)
    launch(p, stream(x.device))
    return y


def causal_conv1d_update(x, conv_state, weight, bias, query_start_loc, state_idx, num_accepted, activation="silu",
                         *, pdl: bool = True):
    """T <= 1 + k <= 16 tokens per row. pdl: a programmatic dependent launch (False: an ordinary
    one, for benchmarks and tests; same results)."""
    if conv_state.shape[1] - weight.shape[-1] + 2 > MAX_TOKENS_PER_ROW:
        raise ValueError(f"at most {MAX_TOKENS_PER_ROW} tokens per decode row")
    return _conv(kernels.causal_conv1d_update, x, conv_state, weight, bias, query_start_loc, state_idx, num_accepted,
                 None, activation, pdl)


def causal_conv1d_fn(x, conv_state, weight, bias, query_start_loc, state_idx, num_accepted, has_initial_state,
                     activation="silu"):
    return _conv(kernels.causal_conv1d_fn, x, conv_state, weight, bias, query_start_loc, state_idx, num_accepted,
                 has_initial_state, activation, True)


def selective_state_update(state, x, dt, A, B, C, D, z, dt_bias, query_start_loc, state_idx, num_accepted,
                           dt_softplus=True, dt_limit=None):
    """state fp32 [slots, H, P, N], N <= 256, 1 + k <= 16."""
    return _state_scan(kernels.selective_state_update, state, x, dt, A, B, C, D, z, dt_bias, query_start_loc,
                       state_idx, num_accepted, dt_softplus, dt_limit, None)


def ssd_chunk_scan(x, dt, A, B, C, D, z, dt_bias, query_start_loc, state, state_idx, num_accepted,
                   has_initial_state, chunk_size=64, dt_softplus=True, dt_limit=None):
    """chunk_size only shapes the reference's arithmetic."""
    return _state_scan(kernels.selective_scan_prefill, state, x, dt, A, B, C, D, z, dt_bias, query_start_loc,
                       state_idx, num_accepted, dt_softplus, dt_limit, _bool(has_initial_state))


def _state_scan(launch: Any, state, x, dt, A, B, C, D, z, dt_bias, query_start_loc, state_idx, num_accepted,
                dt_softplus, dt_limit, init):
    if x.dtype not in DTYPE_CODE:
        raise ValueError(f"x must be fp16/bf16/fp32, got {x.dtype}")
    if state.dtype != torch.float32 or not state.is_contiguous():
        raise ValueError(f"state must be contiguous fp32, got {state.dtype}")
    _, H, P, N = state.shape
    if N > MAX_STATE_SIZE:
        raise ValueError(f"the state kernels take state sizes up to {MAX_STATE_SIZE}, got {N}")
    if state_idx.shape[1] > MAX_TOKENS_PER_ROW:
        raise ValueError(f"at most {MAX_TOKENS_PER_ROW} slots per row")
    dt, B, C, z = (None if t is None else _rows_last_contiguous(t if t.dtype == x.dtype else t.to(x.dtype))
                   for t in (dt, B, C, z))
    x = _rows_last_contiguous(x)
    out = torch.empty((x.shape[0], H, P), dtype=x.dtype, device=x.device)
    idx, qsl, acc = _i32(state_idx), _i32(query_start_loc), _i32(num_accepted)  # referenced until the launch
    a32, d32, bias32 = _f32(A), _f32(D), _f32(dt_bias)
    lo, hi = (-3.0e38, 3.0e38) if dt_limit is None else (float(dt_limit[0]), min(float(dt_limit[1]), 3.0e38))
    p = params(kernels.SelectiveStateUpdateParams, state=ptr(state), x=ptr(x), dt=ptr(dt), B=ptr(B), C=ptr(C),
               z=ptr(z), out=ptr(out), A=ptr(a32), D=ptr(d32), dt_bias=ptr(bias32), query_start_loc=ptr(qsl),
               state_idx=ptr(idx), num_accepted=ptr(acc), num_rows=idx.shape[0], num_heads=H, head_dim=P,
               state_size=N, num_groups=B.shape[1], slots_per_row=idx.shape[1], x_stride_token=x.stride(0),
               dt_stride_token=dt.stride(0), B_stride_token=B.stride(0), C_stride_token=C.stride(0),
               z_stride_token=0 if z is None else z.stride(0), dt_softplus=bool(dt_softplus), dt_min=lo, dt_max=hi,
               dtype=DTYPE_CODE[x.dtype], has_initial_state=ptr(init))
    launch(p, stream(x.device))
    return out
