"""CUDA chunk-wise Gated DeltaNet prefill (hipkernels/ssm/gdn_chunked_prefill.hip): validate, lay out
and launch. Semantics (gdn_chunked_prefill.h; spec: the per-token recurrence of
pyengine/ops/reference/gdn.py, which this equals within fp32 rounding): row n starts from
state[state_idx[n, 0]] when has_initial_state[n] (else zeros), runs its tokens, and writes its final
state back to state[state_idx[n, 0]]; a PAD (-1) first slot writes nothing and gets zero output.

The kernel runs whenever q / k / v are fp16, bf16 or fp32, the pool is contiguous fp32 and K is
a multiple of 4 up to 256 (128 on AMD): a choice made from the model's shapes alone, never from the
batch, so a row takes the same path and gets the same bits whatever else is in the step."""
from __future__ import annotations

import torch

from pyengine.ops import reference
from pyengine.ops.cuda.launch import DTYPE_CODE, kernels, params, ptr, row_stride, stream

MAX_KEY_DIM = 256


def chunk_size() -> int:
    """Tokens per chunk of this build (64 with nvcc, 32 with hipcc)."""
    return kernels.gdn_chunked_prefill_chunk_size()


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[ntok, heads, dim] with dim and heads dense (any token stride)."""
    return t if t.stride(-1) == 1 and t.stride(-2) == t.shape[-1] else t.contiguous()


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
           state: torch.Tensor, query_start_loc: torch.Tensor, state_idx: torch.Tensor) -> None:
    if q.dim() != 3 or k.shape != q.shape or v.dim() != 3 or v.shape[0] != q.shape[0]:
        raise ValueError(f"q and k must be [ntok, H, K], v [ntok, HV, V]: {tuple(q.shape)} {tuple(k.shape)} "
                         f"{tuple(v.shape)}")
    ntok, h, dk = q.shape
    hv, dv = v.shape[1:]
    if hv % h or tuple(state.shape[1:]) != (hv, dv, dk) or state.dtype != torch.float32:
        raise ValueError(f"state must be fp32 [slots, {hv}, {dv}, {dk}] with HV a multiple of H, got "
                         f"{tuple(state.shape)} {state.dtype}")
    if tuple(g.shape) != (ntok, hv) or tuple(beta.shape) != (ntok, hv):
        raise ValueError(f"g and beta must be [ntok, HV] = {(ntok, hv)}: {tuple(g.shape)} {tuple(beta.shape)}")
    if query_start_loc.shape[0] != state_idx.shape[0] + 1:
        raise ValueError(f"{state_idx.shape[0]} rows but query_start_loc has {query_start_loc.shape[0]} entries")


def runs_kernel(q: torch.Tensor, state: torch.Tensor) -> bool:
    return (q.is_cuda and q.dtype in DTYPE_CODE and state.is_contiguous() and state.dtype == torch.float32
            and q.shape[-1] <= MAX_KEY_DIM and q.shape[-1] % 4 == 0)


def chunked_gated_delta_rule_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                     beta: torch.Tensor, state: torch.Tensor, query_start_loc: torch.Tensor,
                                     state_idx: torch.Tensor, has_initial_state: torch.Tensor | None,
                                     scale: float | None = None, l2norm: bool = True) -> torch.Tensor:
    """Prefill rows (varlen) of the gated delta rule in chunk-wise form. q, k [ntok, H, K]; v [ntok,
    HV, V]; g, beta [ntok, HV]; state [slots, HV, V, K] fp32 (updated in place); query_start_loc
    [rows + 1]; state_idx [rows] or [rows, slots_per_row] (column 0 is the row's slot, PAD = -1);
    has_initial_state [rows] bool or None (all true); scale None: K ** -0.5. Returns o [ntok, HV, V]
    in q's dtype."""
    if state_idx.dim() == 1:
        state_idx = state_idx[:, None]
    _check(q, k, v, g, beta, state, query_start_loc, state_idx)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if not runs_kernel(q, state):
        acc = torch.ones(state_idx.shape[0], dtype=torch.int32, device=state_idx.device)
        init = torch.ones_like(acc, dtype=torch.bool) if has_initial_state is None else has_initial_state
        return reference.gated_delta_rule_chunked(q, k, v, g, beta, query_start_loc, state, state_idx, acc, init,
                                                  scale=scale, use_qk_l2norm=l2norm)
    q, k, v = _rows(q), _rows(k.to(q.dtype)), _rows(v.to(q.dtype))
    g32, b32 = g.to(torch.float32).contiguous(), beta.to(torch.float32).contiguous()
    out = torch.empty(v.shape, dtype=q.dtype, device=q.device)
    # every temporary stays referenced until the launch (a freed block could be reused first)
    qsl, idx = query_start_loc.to(torch.int32).contiguous(), state_idx.to(torch.int32).contiguous()
    init = None if has_initial_state is None else has_initial_state.to(torch.bool).contiguous()
    p = params(kernels.GdnChunkedPrefillParams, state=ptr(state), q=ptr(q), k=ptr(k), v=ptr(v), g=ptr(g32),
               beta=ptr(b32), out=ptr(out), query_start_loc=ptr(qsl), state_idx=ptr(idx),
               has_initial_state=ptr(init), num_rows=idx.shape[0], num_k_heads=q.shape[1], num_v_heads=v.shape[1],
               key_dim=q.shape[2], value_dim=v.shape[2], state_idx_stride=idx.shape[1],
               q_stride_token=row_stride(q), k_stride_token=row_stride(k), v_stride_token=row_stride(v),
               scale=scale, l2norm=bool(l2norm), dtype=DTYPE_CODE[q.dtype])
    kernels.gdn_chunked_prefill(p, stream(q.device))
    return out
