"""CUDA Gated DeltaNet ops (hipkernels/ssm/gated_delta_rule.hip): fill the params struct.

The facade has validated the shapes (and that token records fit a slot). Here: the kernel's own
limits (else the reference runs), fp32 g / beta, int32 row metadata and rows with a contiguous last
dim. Decode / verify rows write the base state and per-token records (reference.gdn); prefill rows
run the same kernel token after token with only the final state written, the reference's chunked
form giving the same values within fp32 rounding (the chunked tensor-core form is future work);
materialise replays base + records into a slot of its own with the same device functions."""
from __future__ import annotations

from typing import Any

import torch

from pyengine.ops import reference
from pyengine.ops.cuda.launch import DTYPE_CODE, kernels, params, ptr, stream

MAX_KEY_DIM = 256
MAX_TOKENS_PER_ROW = 16
# Tests and benchmarks: "direct" or "persistent" forces the kernel's grid (K <= 128); None lets the
# kernel pick by the step's size. A row's bits are the same under both (test_grids_agree_bitwise).
force_grid: str | None = None
GRIDS = {None: 0, "direct": 1, "persistent": 2}


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[ntok, heads, dim] with dim and heads dense and rows aligned to 4 elements (any token stride
    that keeps them so): the kernel reads q and k 4 elements at a time."""
    dense = t.stride(-1) == 1 and t.stride(-2) == t.shape[-1]
    aligned = t.data_ptr() % (4 * t.element_size()) == 0 and t.stride(0) % 4 == 0
    return t if dense and aligned else t.contiguous()


def runs_kernel(dtype: torch.dtype, state: torch.Tensor, slots_per_row: int | None) -> bool:
    key_dim = state.shape[-1]
    return (dtype in DTYPE_CODE and state.dtype == torch.float32 and state.is_contiguous()
            and key_dim % 4 == 0 and key_dim <= MAX_KEY_DIM and state.data_ptr() % 16 == 0
            and (slots_per_row is None or slots_per_row <= MAX_TOKENS_PER_ROW))


def _i32(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(t.to(torch.int32).contiguous() for t in tensors)


def _launch(launch: Any, q, k, v, g, beta, state, query_start_loc, state_idx, num_accepted, init) -> torch.Tensor:
    q, k = _rows(q), _rows(k.to(q.dtype))
    v = _rows(v.to(q.dtype))
    g32, b32 = g.to(torch.float32).contiguous(), beta.to(torch.float32).contiguous()
    out = torch.empty(v.shape, dtype=q.dtype, device=q.device)
    # every temporary stays referenced until the launch (a freed block could be reused first)
    idx, qsl, acc = _i32(state_idx, query_start_loc, num_accepted)
    init = None if init is None else init.to(torch.bool).contiguous()
    p = params(kernels.GatedDeltaRuleParams, state=ptr(state), q=ptr(q), k=ptr(k), v=ptr(v), g=ptr(g32),
               beta=ptr(b32), out=ptr(out), query_start_loc=ptr(qsl), state_idx=ptr(idx), num_accepted=ptr(acc),
               has_initial_state=ptr(init), num_rows=idx.shape[0], num_k_heads=q.shape[1], num_v_heads=v.shape[1],
               key_dim=q.shape[2], value_dim=v.shape[2], slots_per_row=idx.shape[1], q_stride_token=q.stride(0),
               k_stride_token=k.stride(0), v_stride_token=v.stride(0), scale=q.shape[2] ** -0.5, l2norm=True,
               dtype=DTYPE_CODE[q.dtype], grid=GRIDS[force_grid])
    launch(p, stream(q.device))
    return out


def gated_delta_rule_update(q, k, v, g, beta, state, query_start_loc, state_idx, num_accepted) -> torch.Tensor:
    if not runs_kernel(q.dtype, state, state_idx.shape[1]):
        return reference.gated_delta_rule_update(q, k, v, g, beta, state, query_start_loc, state_idx, num_accepted)
    return _launch(kernels.gated_delta_rule_update, q, k, v, g, beta, state, query_start_loc, state_idx,
                   num_accepted, None)


def gated_delta_rule_chunked(q, k, v, g, beta, query_start_loc, state, state_idx, num_accepted,
                             has_initial_state) -> torch.Tensor:
    if not runs_kernel(q.dtype, state, None):
        return reference.gated_delta_rule_chunked(q, k, v, g, beta, query_start_loc, state, state_idx, num_accepted,
                                                  has_initial_state)
    return _launch(kernels.gated_delta_rule_prefill, q, k, v, g, beta, state, query_start_loc, state_idx,
                   num_accepted, has_initial_state)


def gated_delta_rule_materialise(state, state_idx, num_accepted, dst) -> None:
    if not runs_kernel(torch.float32, state, None):
        return reference.gated_delta_rule_materialise(state, state_idx, num_accepted, dst)
    idx, acc, dst32 = _i32(state_idx, num_accepted, dst)
    hv, dv, dk = state.shape[1:]
    p = params(kernels.GatedDeltaRuleParams, state=ptr(state), state_idx=ptr(idx), num_accepted=ptr(acc),
               replay_dst=ptr(dst32), num_rows=idx.shape[0], num_k_heads=1, num_v_heads=hv, key_dim=dk, value_dim=dv,
               slots_per_row=idx.shape[1], dtype=DTYPE_CODE[torch.float32], grid=GRIDS[force_grid])
    kernels.gated_delta_rule_materialise(p, stream(state.device))
