"""PyTorch references of the recurrent-state ops of Mamba2 layers (the spec the GPU kernels of
hipkernels/ssm/ssm_state.hip are checked against; shared semantics: ../shared/reference/kernels.md).

Slots and offsets under speculative decoding
    Each request holds a slot row ``state_idx[n, 0..k]`` (PAD = -1). ``num_accepted[n]`` = a is the
    number of tokens the row's previous step committed (1..1+k, bonus included; 1 after a prefill).
    The valid state is the one after input ``a - 1`` of the previous step:
      * SSM state  [L, H, P, N] fp32: slot ``state_idx[n, a-1]``.
      * conv state [L, S, dim], S = W - 1 + k rows (oldest first) of line ``state_idx[n, 0]``:
        the W - 1 rows starting at offset ``a - 1``.
    Nothing is shifted after verification; every step simply reads at the offset. A row whose
    first slot is PAD writes no state and gets zero output.

Batches are flat: token i of row n is ``query_start_loc[n] + i``. Every recurrence accumulates in
fp32. Each function loops over rows in Python: these are references, not fast paths.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

PAD = -1


def _lists(*tensors: torch.Tensor) -> list:
    return [t.tolist() for t in tensors]


def _act(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation in (None, "identity"):
        return y
    if activation in ("silu", "swish"):
        return F.silu(y)
    raise ValueError(f"unsupported activation {activation!r}")


def _conv(seq: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, num_out: int,
          activation: str | None) -> torch.Tensor:
    """Depthwise causal conv: seq [W - 1 + T, dim] (history then inputs) -> [T, dim] fp32."""
    w = weight.float()  # [dim, W]
    windows = seq.float().unfold(0, w.shape[1], 1)[-num_out:]  # [T, dim, W], oldest .. newest
    y = (windows * w).sum(-1)
    if bias is not None:
        y = y + bias.float()
    return _act(y, activation)


def causal_conv1d_update(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         query_start_loc: torch.Tensor, state_idx: torch.Tensor, num_accepted: torch.Tensor,
                         activation: str | None = "silu") -> torch.Tensor:
    """Decode / verify rows, 1..1+k tokens each. x [ntok, dim]; conv_state [L, S, dim];
    weight [dim, W]. Per row: hist = state[line][off : off + W - 1] with off = a - 1,
    y[t] = act(bias + sum_j w[:, j] * concat(hist, x[..t])[-W:][j]), and afterwards
    state[line][0 : W - 2 + T] = concat(state[line][off + 1 : off + W - 1], x) (the shifted window,
    so the next step reads at its own offset). Returns y [ntok, dim] in x's dtype."""
    width = weight.shape[1]
    y = torch.zeros_like(x)
    qsl, idx, acc = _lists(query_start_loc, state_idx, num_accepted)
    for n in range(len(qsl) - 1):
        s, e, line = qsl[n], qsl[n + 1], idx[n][0]
        if line == PAD or e == s:
            continue
        off = max(acc[n], 1) - 1
        assert off + width - 1 <= conv_state.shape[1] and width - 2 + e - s <= conv_state.shape[1], \
            f"row {n}: conv state of {conv_state.shape[1]} rows is too short for offset {off} and {e - s} tokens"
        seq = torch.cat([conv_state[line, off:off + width - 1], x[s:e].to(conv_state.dtype)])
        y[s:e] = _conv(seq, weight, bias, e - s, activation).to(x.dtype)
        conv_state[line, :width - 2 + e - s] = seq[1:]
    return y


def causal_conv1d_fn(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     query_start_loc: torch.Tensor, state_idx: torch.Tensor, num_accepted: torch.Tensor,
                     has_initial_state: torch.Tensor, activation: str | None = "silu") -> torch.Tensor:
    """Prefill rows of any length. History = state[line][a-1 : a-1 + W-1] when the row has an
    initial state (a chunk after an earlier chunk, or after a verify), else zeros; y as in
    causal_conv1d_update; afterwards state[line][0 : W-1] = the last W - 1 rows of concat(history, x)
    (old rows merged in when the chunk is shorter than W - 1), i.e. offset 0 is valid (a = 1)."""
    width = weight.shape[1]
    y = torch.zeros_like(x)
    qsl, idx, acc, init = _lists(query_start_loc, state_idx, num_accepted, has_initial_state)
    for n in range(len(qsl) - 1):
        s, e, line = qsl[n], qsl[n + 1], idx[n][0]
        if line == PAD or e == s:
            continue
        off = max(acc[n], 1) - 1
        if init[n]:
            hist = conv_state[line, off:off + width - 1]
        else:
            hist = torch.zeros(width - 1, x.shape[1], dtype=conv_state.dtype, device=x.device)
        seq = torch.cat([hist, x[s:e].to(conv_state.dtype)])
        y[s:e] = _conv(seq, weight, bias, e - s, activation).to(x.dtype)
        conv_state[line, :width - 1] = seq[-(width - 1):]
    return y


def _discretize(dt: torch.Tensor, dt_bias: torch.Tensor | None, dt_softplus: bool,
                dt_limit: tuple[float, float] | None) -> torch.Tensor:
    d = dt.float() + (dt_bias.float() if dt_bias is not None else 0.0)
    if dt_softplus:
        d = F.softplus(d)  # threshold 20: d itself above it
    if dt_limit is not None and (dt_limit[0] > 0.0 or dt_limit[1] != float("inf")):
        d = d.clamp(dt_limit[0], dt_limit[1])
    return d


def _heads(bc: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[..., G, N] -> [..., H, N]: head h uses group h // (H / G)."""
    return bc.float().repeat_interleave(num_heads // bc.shape[-2], dim=-2)


def _finish(y: torch.Tensor, x: torch.Tensor, D: torch.Tensor | None, z: torch.Tensor | None) -> torch.Tensor:
    if D is not None:
        y = y + D.float()[:, None] * x.float()
    if z is not None:
        y = y * F.silu(z.float())
    return y


def selective_state_update(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                           C: torch.Tensor, D: torch.Tensor | None, z: torch.Tensor | None,
                           dt_bias: torch.Tensor | None, query_start_loc: torch.Tensor, state_idx: torch.Tensor,
                           num_accepted: torch.Tensor, dt_softplus: bool = True,
                           dt_limit: tuple[float, float] | None = None) -> torch.Tensor:
    """Mamba2 multi-token update. state [L, H, P, N]; x, z [ntok, H, P]; dt [ntok, H]; A, D, dt_bias [H];
    B, C [ntok, G, N]. Per row: s = state[idx[n, a-1]] (zeros if PAD); for t in 0..T-1:
    d = softplus(dt + dt_bias); s = s * exp(A d) + d B[t] x[t]^T; state[idx[n, t]] = s (skipped if PAD);
    y[t] = s C[t] + D x[t] (times silu(z[t]) when z is given). Returns y [ntok, H, P] in x's dtype."""
    num_heads = x.shape[1]
    out = torch.zeros_like(x)
    qsl, idx, acc = _lists(query_start_loc, state_idx, num_accepted)
    a_f = A.float()[:, None, None]
    for n in range(len(qsl) - 1):
        s0, e = qsl[n], qsl[n + 1]
        if idx[n][0] == PAD or e == s0:
            continue
        assert e - s0 <= len(idx[n]), f"row {n}: {e - s0} tokens but {len(idx[n])} slots"
        src = idx[n][max(acc[n], 1) - 1]
        s = state[src].float() if src != PAD else state.new_zeros(state.shape[1:], dtype=torch.float32)
        d = _discretize(dt[s0:e], dt_bias, dt_softplus, dt_limit)  # [T, H]
        bh, ch = _heads(B[s0:e], num_heads), _heads(C[s0:e], num_heads)
        for t in range(e - s0):
            s = s * torch.exp(a_f * d[t][:, None, None]) + (d[t][:, None] * bh[t])[:, None, :] * x[s0 + t].float()[:, :, None]
            if idx[n][t] != PAD:
                state[idx[n][t]] = s.to(state.dtype)
            y = (s * ch[t][:, None, :]).sum(-1)
            out[s0 + t] = _finish(y, x[s0 + t], D, None if z is None else z[s0 + t]).to(x.dtype)
    return out


def _chunk_scan(x: torch.Tensor, d: torch.Tensor, A: torch.Tensor, bh: torch.Tensor, ch: torch.Tensor,
                s: torch.Tensor, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """SSD chunked form of the recurrence for one sequence (fp32). x [L, H, P], d [L, H], A [H],
    bh/ch [L, H, N], s [H, P, N] -> (y [L, H, P] without D / z, final state)."""
    ys = []
    for c0 in range(0, x.shape[0], chunk_size):
        xc, dc, bc, cc = (t[c0:c0 + chunk_size] for t in (x, d, bh, ch))
        cum = torch.cumsum(dc * A, dim=0)  # [Lc, H]: log-decay from the chunk start through t
        diff = cum[:, None, :] - cum[None, :, :]  # [t, s, H]
        causal = torch.ones(len(xc), len(xc), dtype=torch.bool, device=x.device).tril()[:, :, None]
        decay = torch.exp(diff.masked_fill(~causal, float("-inf")))
        scores = torch.einsum("thn,shn->tsh", cc, bc) * decay * dc[None, :, :]
        y = torch.einsum("tsh,shp->thp", scores, xc)
        y = y + torch.einsum("thn,hpn->thp", cc, s) * torch.exp(cum)[:, :, None]
        to_end = torch.exp(cum[-1][None, :] - cum) * dc  # [Lc, H]
        s = s * torch.exp(cum[-1])[:, None, None] + torch.einsum("sh,shn,shp->hpn", to_end, bc, xc)
        ys.append(y)
    return torch.cat(ys), s


def ssd_chunk_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                   D: torch.Tensor | None, z: torch.Tensor | None, dt_bias: torch.Tensor | None,
                   query_start_loc: torch.Tensor, state: torch.Tensor, state_idx: torch.Tensor,
                   num_accepted: torch.Tensor, has_initial_state: torch.Tensor, chunk_size: int = 64,
                   dt_softplus: bool = True, dt_limit: tuple[float, float] | None = None) -> torch.Tensor:
    """Prefill rows (varlen) in chunked form, equal to the recurrence of selective_state_update.
    Initial state: state[idx[n, a-1]] when has_initial_state[n], else zeros. The final state is
    written to state[idx[n, 0]] (a = 1 for the next step). Returns y [ntok, H, P]."""
    num_heads = x.shape[1]
    out = torch.zeros_like(x)
    qsl, idx, acc, init = _lists(query_start_loc, state_idx, num_accepted, has_initial_state)
    for n in range(len(qsl) - 1):
        s0, e = qsl[n], qsl[n + 1]
        if idx[n][0] == PAD or e == s0:
            continue
        src = idx[n][max(acc[n], 1) - 1]
        s = state[src].float() if init[n] else state.new_zeros(state.shape[1:], dtype=torch.float32)
        d = _discretize(dt[s0:e], dt_bias, dt_softplus, dt_limit)
        y, s = _chunk_scan(x[s0:e].float(), d, A.float(), _heads(B[s0:e], num_heads), _heads(C[s0:e], num_heads), s,
                           chunk_size)
        state[idx[n][0]] = s.to(state.dtype)
        out[s0:e] = _finish(y, x[s0:e], D, None if z is None else z[s0:e]).to(x.dtype)
    return out


def copy_state(state: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """state[dst[i]] = state[src[i]] for every pair with neither slot PAD (any pool: SSM or conv)."""
    keep = (src != PAD) & (dst != PAD)
    state[dst[keep].long()] = state[src[keep].long()].clone()


def normalize_state(conv_state: torch.Tensor, ssm_state: torch.Tensor, state_idx: torch.Tensor,
                    num_accepted: torch.Tensor, width: int) -> None:
    """Move each row's valid state to column 0 / offset 0 (afterwards a = 1): SSM slot
    idx[n, a-1] -> idx[n, 0]; conv rows [a-1, a-1 + W-1) -> [0, W-1) of line idx[n, 0]."""
    idx, acc = _lists(state_idx, num_accepted)
    for row, a in zip(idx, acc):
        off = max(a, 1) - 1
        if row[0] == PAD or off == 0:
            continue
        ssm_state[row[0]] = ssm_state[row[off]].clone()
        conv_state[row[0], :width - 1] = conv_state[row[0], off:off + width - 1].clone()
