"""CUDA recurrent-state ops: thin wrappers over hipkernels/ssm_state.hip (pyengine._C.kernels), with
the signatures and semantics of pyengine.ops.ssm_reference (the spec they are tested against).

The wrappers validate shapes and dtypes (ValueError), cast the per-head parameters (A, D, dt_bias)
to fp32 and the row metadata to int32, and pass raw pointers plus the current stream. The chunked
prefill scan runs the selective-state kernel token after token with only the final state written
(correct; the chunked tensor-core form is future work); the state copies run the PyTorch reference.
"""
from __future__ import annotations

import torch

from pyengine.ops import ssm_reference

try:
    from pyengine import _C

    _K = _C.kernels if getattr(_C, "has_kernels", False) else None
except ImportError:  # extension not built
    _K = None

if _K is None or not hasattr(_K, "selective_state_update"):
    raise ImportError("pyengine._C was built without the recurrent-state GPU kernels")

_DTYPE_CODE = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}
MAX_TOKENS_PER_ROW = 16
MAX_STATE_SIZE = 256
MAX_CONV_WIDTH = 8

copy_state = ssm_reference.copy_state
normalize_state = ssm_reference.normalize_state


def _stream(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream


def _i32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.int32).contiguous()


def _f32(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.to(torch.float32).contiguous()


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def _rows_last_contiguous(name: str, t: torch.Tensor, dims: int) -> torch.Tensor:
    if t.dim() != dims:
        raise ValueError(f"{name} must have {dims} dims, got {tuple(t.shape)}")
    inner_contig = t[0].is_contiguous() if t.shape[0] else True
    return t if inner_contig and t.stride(-1) == 1 else t.contiguous()


def _conv(kernel, x, conv_state, weight, bias, query_start_loc, state_idx, num_accepted, has_initial_state,
          activation) -> torch.Tensor:
    if x.device.type != "cuda" or x.dtype not in _DTYPE_CODE:
        raise ValueError(f"x must be a CUDA fp16/bf16/fp32 tensor, got {x.device} {x.dtype}")
    if conv_state.dim() != 3 or not conv_state.is_contiguous() or conv_state.dtype != x.dtype:
        raise ValueError(f"conv_state must be contiguous [slots, rows, dim] of x's dtype, got {tuple(conv_state.shape)}")
    width = weight.shape[-1]
    if not 2 <= width <= MAX_CONV_WIDTH or x.dim() != 2 or x.shape[1] != conv_state.shape[2]:
        raise ValueError(f"x [ntok, dim] / weight [dim, W<= {MAX_CONV_WIDTH}] mismatch: {tuple(x.shape)} {tuple(weight.shape)}")
    if activation not in ("silu", "swish", None, "identity"):
        raise ValueError(f"unsupported activation {activation!r}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    w = weight.reshape(weight.shape[0], width).to(x.dtype).contiguous()
    b = None if bias is None else bias.to(x.dtype).contiguous()
    # Every temporary stays referenced until the launch: a freed block could be reused (and
    # overwritten) by the next conversion before the kernel reads it.
    idx, qsl, acc = _i32(state_idx), _i32(query_start_loc), _i32(num_accepted)
    init = None if has_initial_state is None else has_initial_state.to(torch.bool).contiguous()
    kernel(_ptr(x), _ptr(y), _ptr(conv_state), _ptr(w), _ptr(b), _ptr(qsl), _ptr(idx), _ptr(acc), _ptr(init), idx.shape[0], x.shape[1], width, conv_state.shape[1], idx.shape[1],
           x.stride(0), y.stride(0), activation in ("silu", "swish"), _DTYPE_CODE[x.dtype], _stream(x.device))
    return y


def causal_conv1d_update(x, conv_state, weight, bias, query_start_loc, state_idx, num_accepted, activation="silu"):
    """See ssm_reference.causal_conv1d_update; T <= 1 + k <= 16 tokens per row."""
    if conv_state.shape[1] - weight.shape[-1] + 2 > MAX_TOKENS_PER_ROW:
        raise ValueError(f"at most {MAX_TOKENS_PER_ROW} tokens per decode row")
    return _conv(_K.causal_conv1d_update, x, conv_state, weight, bias, query_start_loc, state_idx, num_accepted,
                 None, activation)


def causal_conv1d_fn(x, conv_state, weight, bias, query_start_loc, state_idx, num_accepted, has_initial_state,
                     activation="silu"):
    """See ssm_reference.causal_conv1d_fn."""
    return _conv(_K.causal_conv1d_fn, x, conv_state, weight, bias, query_start_loc, state_idx, num_accepted,
                 has_initial_state, activation)


def selective_state_update(state, x, dt, A, B, C, D, z, dt_bias, query_start_loc, state_idx, num_accepted,
                           dt_softplus=True, dt_limit=None):
    """See ssm_reference.selective_state_update; state fp32 [slots, H, P, N], N <= 256, 1 + k <= 16."""
    return _state_scan(state, x, dt, A, B, C, D, z, dt_bias, query_start_loc, state_idx, num_accepted,
                       dt_softplus, dt_limit, None, prefill=False)


def ssd_chunk_scan(x, dt, A, B, C, D, z, dt_bias, query_start_loc, state, state_idx, num_accepted,
                   has_initial_state, chunk_size=64, dt_softplus=True, dt_limit=None):
    """See ssm_reference.ssd_chunk_scan (chunk_size only shapes the reference's arithmetic)."""
    init = None if has_initial_state is None else has_initial_state.to(torch.bool).contiguous()
    if init is not None and init.shape[0] != state_idx.shape[0]:
        raise ValueError(f"has_initial_state has {init.shape[0]} rows, state_idx {state_idx.shape[0]}")
    return _state_scan(state, x, dt, A, B, C, D, z, dt_bias, query_start_loc, state_idx, num_accepted,
                       dt_softplus, dt_limit, init, prefill=True)


def _state_scan(state, x, dt, A, B, C, D, z, dt_bias, query_start_loc, state_idx, num_accepted, dt_softplus,
                dt_limit, init, prefill: bool):
    if x.device.type != "cuda" or x.dtype not in _DTYPE_CODE:
        raise ValueError(f"x must be a CUDA fp16/bf16/fp32 tensor, got {x.device} {x.dtype}")
    if state.dtype != torch.float32 or state.dim() != 4 or not state.is_contiguous():
        raise ValueError(f"state must be contiguous fp32 [slots, H, P, N], got {state.dtype} {tuple(state.shape)}")
    _, H, P, N = state.shape
    G = B.shape[1]
    if N > MAX_STATE_SIZE or H % G or tuple(x.shape[1:]) != (H, P) or tuple(B.shape[1:]) != (G, N) \
            or B.shape != C.shape or tuple(dt.shape[1:]) != (H,):
        raise ValueError(f"shape mismatch: state {tuple(state.shape)} x {tuple(x.shape)} dt {tuple(dt.shape)} "
                         f"B {tuple(B.shape)} C {tuple(C.shape)}")
    if state_idx.shape[1] > MAX_TOKENS_PER_ROW:
        raise ValueError(f"at most {MAX_TOKENS_PER_ROW} slots per row")
    cast = [t if t is None or t.dtype == x.dtype else t.to(x.dtype) for t in (dt, B, C, z)]
    dt, B, C, z = (None if t is None else _rows_last_contiguous(n, t, d)
                   for t, n, d in zip(cast, ("dt", "B", "C", "z"), (2, 3, 3, 3)))
    x = _rows_last_contiguous("x", x, 3)
    out = torch.empty((x.shape[0], H, P), dtype=x.dtype, device=x.device)
    idx, qsl, acc = _i32(state_idx), _i32(query_start_loc), _i32(num_accepted)  # referenced until the launch
    a32, d32, bias32 = _f32(A), _f32(D), _f32(dt_bias)
    lo, hi = (-3.0e38, 3.0e38) if dt_limit is None else (float(dt_limit[0]), min(float(dt_limit[1]), 3.0e38))
    _K.selective_state_update(
        _ptr(state), _ptr(x), _ptr(dt), _ptr(B), _ptr(C), _ptr(z), _ptr(out), _ptr(a32), _ptr(d32),
        _ptr(bias32), _ptr(qsl), _ptr(idx), _ptr(acc), idx.shape[0], H, P, N,
        G, idx.shape[1], x.stride(0), dt.stride(0), B.stride(0), C.stride(0), 0 if z is None else z.stride(0),
        bool(dt_softplus), lo, hi, _DTYPE_CODE[x.dtype], _stream(x.device), _ptr(init), prefill)
    return out
