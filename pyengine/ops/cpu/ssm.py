"""CPU recurrent-state ops of Mamba2 layers: a token's bits depend only on its own row's history.

Slots, offsets and results are pyengine/ops/reference/ssm.py's (the spec); the arithmetic differs
where the reference's depends on the step:
  * prefill (ssd_chunk_scan) runs the decode recurrence token after token, through the same
    per-token function as selective_state_update, and writes only the final state (to idx[n, 0]),
    as the CUDA backend does: the chunked form's bits depend on where the prompt was cut;
  * the conv sums its W taps oldest first with elementwise ops (the reference's .sum over
    [T, dim, W] picks its order by shape), the same function for update and prefill rows;
  * softplus, exp and silu run over rows padded to a multiple of 64 values (ops.rowwise).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pyengine.ops.reference.ssm import PAD
from pyengine.ops.rowwise import rowwise


def _heads(bc: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[T, G, N] -> [T, H, N] fp32: head h uses group h // (H / G)."""
    return bc.float().repeat_interleave(num_heads // bc.shape[-2], dim=-2)


def _conv(seq: torch.Tensor, weight_taps: torch.Tensor, bias: torch.Tensor | None, num_out: int,
          activation: str | None) -> torch.Tensor:
    """Depthwise causal conv: seq [W - 1 + T, dim] (history then inputs), weight_taps [W, dim] fp32
    -> [T, dim] fp32: each output the sum of its W taps oldest first, plus bias, then activation."""
    seq = seq.float()
    y = seq[:num_out] * weight_taps[0]
    for j in range(1, weight_taps.shape[0]):
        y = y + seq[j:j + num_out] * weight_taps[j]
    if bias is not None:
        y = y + bias.float()
    return y if activation in (None, "identity") else rowwise(F.silu, y)


def _conv_rows(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               query_start_loc: torch.Tensor, state_idx: torch.Tensor, num_accepted: torch.Tensor,
               has_initial_state: torch.Tensor | None, activation: str | None) -> torch.Tensor:
    """Both conv ops; has_initial_state None: decode / verify rows (history always read, the
    shifted window kept for the next step's offset), else prefill rows (window at offset 0)."""
    width = weight.shape[1]
    taps = weight.float().t().contiguous()  # [W, dim]
    y = torch.zeros_like(x)
    qsl, idx, acc = query_start_loc.tolist(), state_idx.tolist(), num_accepted.tolist()
    init = [True] * len(idx) if has_initial_state is None else has_initial_state.tolist()
    for n in range(len(qsl) - 1):
        s, e, line = qsl[n], qsl[n + 1], idx[n][0]
        if line == PAD or e == s:
            continue
        off = max(acc[n], 1) - 1
        if has_initial_state is None:
            assert off + width - 1 <= conv_state.shape[1] and width - 2 + e - s <= conv_state.shape[1], \
                f"row {n}: conv state of {conv_state.shape[1]} rows is too short for offset {off} and {e - s} tokens"
        if init[n]:
            hist = conv_state[line, off:off + width - 1]
        else:
            hist = torch.zeros(width - 1, x.shape[1], dtype=conv_state.dtype, device=x.device)
        seq = torch.cat([hist, x[s:e].to(conv_state.dtype)])
        y[s:e] = _conv(seq, taps, bias, e - s, activation).to(x.dtype)
        if has_initial_state is None:
            conv_state[line, :width - 2 + e - s] = seq[1:]
        else:
            conv_state[line, :width - 1] = seq[-(width - 1):]
    return y


def causal_conv1d_update(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         query_start_loc: torch.Tensor, state_idx: torch.Tensor, num_accepted: torch.Tensor,
                         activation: str | None = "silu") -> torch.Tensor:
    return _conv_rows(x, conv_state, weight, bias, query_start_loc, state_idx, num_accepted, None, activation)


def causal_conv1d_fn(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     query_start_loc: torch.Tensor, state_idx: torch.Tensor, num_accepted: torch.Tensor,
                     has_initial_state: torch.Tensor, activation: str | None = "silu") -> torch.Tensor:
    return _conv_rows(x, conv_state, weight, bias, query_start_loc, state_idx, num_accepted, has_initial_state,
                      activation)


def _ssm_token(s: torch.Tensor, decay: torch.Tensor, d: torch.Tensor, x: torch.Tensor, b: torch.Tensor,
               c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the recurrence, fp32: s [H, P, N], decay = exp(A d) and d [H], x [H, P], b and c
    [H, N] -> (s * decay + d b x^T, y = s c [H, P])."""
    s = s * decay[:, None, None] + (d[:, None] * b)[:, None, :] * x[:, :, None]
    return s, (s * c[:, None, :]).sum(-1)


def _scan_rows(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
               C: torch.Tensor, D: torch.Tensor | None, z: torch.Tensor | None, dt_bias: torch.Tensor | None,
               query_start_loc: torch.Tensor, state_idx: torch.Tensor, num_accepted: torch.Tensor,
               has_initial_state: torch.Tensor | None, dt_softplus: bool,
               dt_limit: tuple[float, float] | None) -> torch.Tensor:
    """Both scan ops; has_initial_state None: decode / verify rows (every token's state to its own
    slot), else prefill rows (only the final state, to idx[n, 0])."""
    num_heads = x.shape[1]
    out = torch.zeros_like(x)
    d_all = dt.float() + (dt_bias.float() if dt_bias is not None else 0.0)  # [ntok, H]
    if dt_softplus:
        d_all = rowwise(F.softplus, d_all)  # threshold 20: d itself above it
    if dt_limit is not None and (dt_limit[0] > 0.0 or dt_limit[1] != float("inf")):
        d_all = d_all.clamp(dt_limit[0], dt_limit[1])
    decay_all = rowwise(torch.exp, d_all * A.float())
    qsl, idx, acc = query_start_loc.tolist(), state_idx.tolist(), num_accepted.tolist()
    init = [True] * len(idx) if has_initial_state is None else has_initial_state.tolist()
    for n in range(len(qsl) - 1):
        s0, e = qsl[n], qsl[n + 1]
        if idx[n][0] == PAD or e == s0:
            continue
        if has_initial_state is None:
            assert e - s0 <= len(idx[n]), f"row {n}: {e - s0} tokens but {len(idx[n])} slots"
        src = idx[n][max(acc[n], 1) - 1]
        s = state[src].float() if init[n] and src != PAD else state.new_zeros(state.shape[1:], dtype=torch.float32)
        xr = x[s0:e].float()
        bh, ch = _heads(B[s0:e], num_heads), _heads(C[s0:e], num_heads)
        y = torch.empty_like(xr)
        for t in range(e - s0):
            s, y_t = _ssm_token(s, decay_all[s0 + t], d_all[s0 + t], xr[t], bh[t], ch[t])
            y[t] = y_t
            if has_initial_state is None and idx[n][t] != PAD:
                state[idx[n][t]] = s.to(state.dtype)
        if has_initial_state is not None:
            state[idx[n][0]] = s.to(state.dtype)
        if D is not None:
            y = y + D.float()[:, None] * xr
        if z is not None:
            y = y * rowwise(F.silu, z[s0:e].float().reshape(e - s0, -1)).view(y.shape)
        out[s0:e] = y.to(x.dtype)
    return out


def selective_state_update(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                           C: torch.Tensor, D: torch.Tensor | None, z: torch.Tensor | None,
                           dt_bias: torch.Tensor | None, query_start_loc: torch.Tensor, state_idx: torch.Tensor,
                           num_accepted: torch.Tensor, dt_softplus: bool = True,
                           dt_limit: tuple[float, float] | None = None) -> torch.Tensor:
    return _scan_rows(state, x, dt, A, B, C, D, z, dt_bias, query_start_loc, state_idx, num_accepted, None,
                      dt_softplus, dt_limit)


def ssd_chunk_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                   D: torch.Tensor | None, z: torch.Tensor | None, dt_bias: torch.Tensor | None,
                   query_start_loc: torch.Tensor, state: torch.Tensor, state_idx: torch.Tensor,
                   num_accepted: torch.Tensor, has_initial_state: torch.Tensor, chunk_size: int = 64,
                   dt_softplus: bool = True, dt_limit: tuple[float, float] | None = None) -> torch.Tensor:
    """chunk_size only shapes the reference's arithmetic."""
    return _scan_rows(state, x, dt, A, B, C, D, z, dt_bias, query_start_loc, state_idx, num_accepted,
                      has_initial_state, dt_softplus, dt_limit)
