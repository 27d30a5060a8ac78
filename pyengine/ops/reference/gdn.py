"""PyTorch references of the Gated DeltaNet (GDN) recurrence of Qwen3-Next's linear-attention layers
(shared semantics: ../shared/reference/kernels.md, "Gated DeltaNet"; oracle: transformers'
torch_recurrent_gated_delta_rule / torch_chunk_gated_delta_rule).

Recurrence, per value head hv (q/k head h = hv // (HV / H)), state S [K, V] fp32
    q = l2norm(q) * scale, k = l2norm(k)       (l2norm: x * rsqrt(sum(x * x) + 1e-6), when enabled)
    S = S * exp(g_t);  delta = beta_t * (v_t - S^T k_t);  S = S + outer(k_t, delta);  o_t = S^T q_t
i.e. S_t = e^{g_t} (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T. g (log-decay, <= 0) and beta
arrive precomputed in fp32: g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b).

Slots and offsets under speculative decoding (as ssm.py)
    The pool is [L, HV, V, K] fp32: S transposed, one value row's K entries contiguous (the
    layout the GPU kernel streams; HF keeps [K, V]). Each request holds a slot row ``state_idx[n, 0..k]``
    (PAD = -1); ``num_accepted[n]`` = a (1..1+k, clamped to >= 1) is the number of tokens the row's
    previous step committed. The valid state is ``state[idx[n, a-1]]`` (zeros if that slot is PAD).
    Decode / verify rows write the state after token t to slot ``idx[n, t]``; prefill rows write their
    final state to ``idx[n, 0]`` (a = 1 next step). A row whose first slot is PAD writes no state and
    gets zero output.

Speculative decoding is lossless only if token t of a verify row gives bit-identical output and state
to T single-token calls: gated_delta_rule_update therefore runs exactly the same tensor ops per token,
on shapes that depend on neither T nor the other rows of the batch.

Batches are flat: token i of row n is ``query_start_loc[n] + i``. Everything accumulates in fp32.
Each function loops over rows in Python: these are references, not fast paths.
"""
from __future__ import annotations

import torch

PAD = -1


def _lists(*tensors: torch.Tensor) -> list:
    return [t.tolist() for t in tensors]


def _qk(q: torch.Tensor, k: torch.Tensor, num_v_heads: int, scale: float, use_qk_l2norm: bool
        ) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [..., H, K] -> fp32 [..., HV, K]: l2-normalised over K (if enabled), q times scale, and
    head h repeated for value heads h * HV/H .. (h + 1) * HV/H - 1 (repeat_interleave)."""
    q, k = q.float(), k.float()
    if use_qk_l2norm:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q = q * scale
    rep = num_v_heads // q.shape[-2]
    return q.repeat_interleave(rep, dim=-2), k.repeat_interleave(rep, dim=-2)


def _initial(state: torch.Tensor, slot: int, use: bool) -> torch.Tensor:
    """S [HV, K, V] fp32 from pool slot `slot` ([HV, V, K]), or zeros."""
    if use and slot != PAD:
        return state[slot].float().transpose(-1, -2)
    return state.new_zeros(state.shape[1:], dtype=torch.float32).transpose(-1, -2)


def _store(state: torch.Tensor, slot: int, S: torch.Tensor) -> None:
    state[slot] = S.transpose(-1, -2).to(state.dtype)


def _step(S: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
          scale: float, use_qk_l2norm: bool, state_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """One token: S [HV, K, V] fp32, q and k [H, K], v [HV, V], g and beta [HV] -> (S rounded to
    state_dtype and back, o [HV, V] fp32). No shape depends on the step."""
    qt, kt = _qk(q, k, v.shape[0], scale, use_qk_l2norm)  # [HV, K]
    S = S * torch.exp(g.float())[:, None, None]
    kv_mem = (S * kt[:, :, None]).sum(-2)  # [HV, V]
    delta = beta.float()[:, None] * (v.float() - kv_mem)
    S = (S + kt[:, :, None] * delta[:, None, :]).to(state_dtype).float()
    return S, (S * qt[:, :, None]).sum(-2)


def recurrent_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   state: torch.Tensor, query_start_loc: torch.Tensor, state_idx: torch.Tensor,
                   num_accepted: torch.Tensor, has_initial_state: torch.Tensor | None, scale: float | None = None,
                   use_qk_l2norm: bool = True) -> torch.Tensor:
    """The recurrence token after token, one per-token function for every kind of row.
    has_initial_state None: decode / verify rows (gated_delta_rule_update); else prefill rows of any
    length with gated_delta_rule_chunked's slots (initial state only where has_initial_state, the
    final state alone written, to idx[n, 0]), bit for bit the tokens' decode steps."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out = torch.zeros_like(v)
    qsl, idx, acc = _lists(query_start_loc, state_idx, num_accepted)
    init = [True] * len(idx) if has_initial_state is None else has_initial_state.tolist()
    for n in range(len(qsl) - 1):
        s0, e = qsl[n], qsl[n + 1]
        if idx[n][0] == PAD or e == s0:
            continue
        if has_initial_state is None:
            assert e - s0 <= len(idx[n]), f"row {n}: {e - s0} tokens but {len(idx[n])} slots"
        S = _initial(state, idx[n][max(acc[n], 1) - 1], bool(init[n]))  # [HV, K, V]
        for t in range(e - s0):
            i = s0 + t
            S, o = _step(S, q[i], k[i], v[i], g[i], beta[i], scale, use_qk_l2norm, state.dtype)
            if has_initial_state is None and idx[n][t] != PAD:
                _store(state, idx[n][t], S)
            out[i] = o.to(v.dtype)
        if has_initial_state is not None:
            _store(state, idx[n][0], S)
    return out


def gated_delta_rule_update(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                            state: torch.Tensor, query_start_loc: torch.Tensor, state_idx: torch.Tensor,
                            num_accepted: torch.Tensor, scale: float | None = None,
                            use_qk_l2norm: bool = True) -> torch.Tensor:
    """Decode / verify rows, 1..1+k tokens each. q, k [ntok, H, K]; v [ntok, HV, V]; g, beta [ntok, HV]
    fp32; state [L, HV, V, K]. Per row: S = state[idx[n, a-1]]; for each token t the recurrence of
    the module docstring, then state[idx[n, t]] = S (skipped if PAD). The state is rounded to the pool
    dtype after every token (a no-op for fp32), so a row of T tokens equals T single-token calls bit
    for bit. Returns o [ntok, HV, V] in v's dtype (zeros for PAD rows)."""
    return recurrent_rows(q, k, v, g, beta, state, query_start_loc, state_idx, num_accepted, None, scale,
                          use_qk_l2norm)


def _chunk_scan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                S: torch.Tensor, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunk-wise (WY / UT-transform) form of the recurrence for one sequence, fp32, heads first:
    q, k [HV, L, K]; v [HV, L, V]; g, beta [HV, L]; S [HV, K, V] -> (o [HV, L, V], final S).

    Within a chunk starting from S0, with G_t = exp(cumsum(g)_t) and u_s the delta of token s,
        S_t = G_t S0 + sum_{s<=t} (G_t / G_s) k_s u_s^T
        u_t = beta_t (v_t - G_t S0^T k_t - sum_{s<t} (G_t / G_s) (k_t . k_s) u_s)
    so (I + A) U = beta V - (beta G K) S0 with A[t, s] = beta_t (k_t . k_s) G_t / G_s for s < t,
    solved by forward substitution; o_t = G_t S0^T q_t + sum_{s<=t} (G_t / G_s) (q_t . k_s) u_s."""
    outs = []
    for c0 in range(0, q.shape[1], chunk_size):
        qc, kc, vc, gc, bc = (x[:, c0:c0 + chunk_size] for x in (q, k, v, g, beta))
        n = qc.shape[1]
        cum = gc.cumsum(-1)  # [HV, n]: log-decay from the chunk start through t
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        decay = (cum[:, :, None] - cum[:, None, :]).masked_fill(~causal, float("-inf")).exp()  # [HV, t, s]
        kb = kc * bc[:, :, None]
        system = torch.eye(n, device=q.device) + (kb @ kc.transpose(-1, -2) * decay).tril(-1)
        rhs = torch.cat([vc * bc[:, :, None], kb * cum.exp()[:, :, None]], dim=-1)
        sol = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        u = sol[..., :vc.shape[-1]] - sol[..., vc.shape[-1]:] @ S  # [HV, n, V]
        o = (qc * cum.exp()[:, :, None]) @ S + (qc @ kc.transpose(-1, -2) * decay) @ u
        to_end = (cum[:, -1:] - cum).exp()  # [HV, n]: decay from token s through the chunk end
        S = S * cum[:, -1].exp()[:, None, None] + (kc * to_end[:, :, None]).transpose(-1, -2) @ u
        outs.append(o)
    return torch.cat(outs, dim=1), S


def gated_delta_rule_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                             query_start_loc: torch.Tensor, state: torch.Tensor, state_idx: torch.Tensor,
                             num_accepted: torch.Tensor, has_initial_state: torch.Tensor, chunk_size: int = 64,
                             scale: float | None = None, use_qk_l2norm: bool = True) -> torch.Tensor:
    """Prefill rows (varlen, any length) in chunked form, equal to the recurrence of
    gated_delta_rule_update within fp32 rounding. Initial state: state[idx[n, a-1]] when
    has_initial_state[n], else zeros. The final state is written to state[idx[n, 0]] (a = 1 for the
    next step). Shapes as gated_delta_rule_update. Returns o [ntok, HV, V] in v's dtype."""
    num_v_heads = v.shape[1]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out = torch.zeros_like(v)
    qsl, idx, acc, init = _lists(query_start_loc, state_idx, num_accepted, has_initial_state)
    for n in range(len(qsl) - 1):
        s0, e = qsl[n], qsl[n + 1]
        if idx[n][0] == PAD or e == s0:
            continue
        S = _initial(state, idx[n][max(acc[n], 1) - 1], bool(init[n]))
        qh, kh = _qk(q[s0:e], k[s0:e], num_v_heads, scale, use_qk_l2norm)  # [T, HV, K]
        heads_first = [x.transpose(0, 1) for x in (qh, kh, v[s0:e].float(), g[s0:e].float(), beta[s0:e].float())]
        o, S = _chunk_scan(*heads_first, S, chunk_size)
        _store(state, idx[n][0], S)
        out[s0:e] = o.transpose(0, 1).to(v.dtype)
    return out
