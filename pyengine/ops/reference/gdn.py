"""PyTorch references of the Gated DeltaNet (GDN) recurrence of Qwen3-Next's linear-attention layers
(shared semantics: ../shared/reference/kernels.md, "Gated DeltaNet"; oracle: transformers'
torch_recurrent_gated_delta_rule / torch_chunk_gated_delta_rule).

Recurrence, per value head hv (q/k head h = hv // (HV / H)), state S [K, V] fp32
    q = l2norm(q) * scale, k = l2norm(k)       (l2norm: x * rsqrt(sum(x * x) + 1e-6), when enabled)
    S = S * exp(g_t);  delta = beta_t * (v_t - S^T k_t);  S = S + outer(k_t, delta);  o_t = S^T q_t
i.e. S_t = e^{g_t} (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T. Both reads come from the state
before the token (what the CUDA kernel computes, in one pass over the state):
    delta = beta_t (v_t - e^{g_t} S_{t-1}^T k_t),   o_t = e^{g_t} S_{t-1}^T q_t + delta (k_t . q_t).
g (log-decay, <= 0) and beta arrive precomputed in fp32: g = -exp(A_log) * softplus(a + dt_bias),
beta = sigmoid(b).

Slots under speculative decoding: a base state and per-token records
    The pool is [L, HV, V, K] fp32: S transposed, one value row's K entries contiguous (the layout the
    GPU kernel streams; HF keeps [K, V]). Each request holds a slot row ``state_idx[n, 0..k]`` (PAD =
    -1); ``num_accepted[n]`` = a (clamped to 1..len(row)) is the number of tokens the row's previous
    step committed. A decode / verify step of T tokens writes
        idx[n, 0]      the full state after its token 0 (always committed): the row's base state
        idx[n, t]      t = 1..T-1: the record of token t, what replaying it needs (below), not a state
    so the state after the previous step's a committed tokens is base + replay of records
    idx[n, 1..a-1] (S = S * decay; S = S + outer(k, delta): the same fp32 ops on the same values as
    the token's own update, hence the same bits). Each step reads the base, replays the a - 1 records,
    then runs its own tokens: one state read and one state written per step whatever T is, instead of
    T states written. Prefill rows start from the same base + records (when has_initial_state, else
    zeros) and write their final state to idx[n, 0] (a = 1 next step). A row whose first slot is PAD
    writes nothing and gets zero output; a PAD record slot is neither written nor replayed.
    gated_delta_rule_materialise writes base + records into a slot of its own (prefix-caching
    checkpoint saves: the state after any token of the last step).

Record layout (per slot and value head, the flat [V * K] view of state[slot, hv]): value rows in tiles
of RECORD_ROWS; tile c owns the RECORD_WIDTH = K + RECORD_ROWS + 4 floats at c * RECORD_WIDTH:
    [0, K)              k_t, l2-normalised (fp32), a private copy per tile
    [K, K + R)          delta_t of the tile's value rows c * R + i (entries past V unused)
    K + R               decay_t = exp(g_t), a private copy per tile; 3 floats of padding follow
The GPU kernel runs one block per (row, value head, tile): every block reads and writes only its own
tile's record, so records of one step never race with the previous step's that other blocks still
read (gated_delta_rule.h). Needs ceil(V / R) * (K + R + 4) <= V * K (records_fit).

Speculative decoding is lossless only if token t of a verify row gives bit-identical output and state
to T single-token calls: every token runs exactly the same tensor ops (_step), on shapes that depend on
neither T nor the other rows of the batch, and the replay (_replay) the same ops as _step's update.

Batches are flat: token i of row n is ``query_start_loc[n] + i``. Everything accumulates in fp32.
Each function loops over rows in Python: these are references, not fast paths.
"""
from __future__ import annotations

import torch

PAD = -1
RECORD_ROWS = 32  # value rows per record tile: the CUDA kernel's value rows per block


def record_width(key_dim: int) -> int:
    return key_dim + RECORD_ROWS + 4


def records_fit(key_dim: int, value_dim: int) -> bool:
    """A value head's records fit in its [V, K] part of a slot."""
    return -(-value_dim // RECORD_ROWS) * record_width(key_dim) <= value_dim * key_dim


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


def _tiles(state: torch.Tensor, slot: int) -> torch.Tensor:
    """The record tiles of a slot, a view [HV, tiles, RECORD_WIDTH] of its first floats per head."""
    hv, dv, dk = state.shape[1:]
    n = -(-dv // RECORD_ROWS)
    return state[slot].view(hv, dv * dk)[:, :n * record_width(dk)].view(hv, n, record_width(dk))


def _write_record(state: torch.Tensor, slot: int, k: torch.Tensor, decay: torch.Tensor, delta: torch.Tensor) -> None:
    """Token record into `slot`: k [HV, K], decay [HV], delta [HV, V] (fp32), every tile's copy."""
    tiles, dk, dv = _tiles(state, slot), k.shape[-1], delta.shape[-1]
    tiles[:, :, :dk] = k[:, None, :]
    tiles[:, :, dk + RECORD_ROWS] = decay[:, None]
    for c in range(tiles.shape[1]):
        rows = min(RECORD_ROWS, dv - c * RECORD_ROWS)
        tiles[:, c, dk:dk + rows] = delta[:, c * RECORD_ROWS:c * RECORD_ROWS + rows]


def _decay(S: torch.Tensor, decay: torch.Tensor) -> torch.Tensor:
    """S [HV, K, V] times decay, [HV, 1, 1] or per value row [HV, 1, V]."""
    return S * decay


def _add_update(S: torch.Tensor, k: torch.Tensor, delta: torch.Tensor, state_dtype: torch.dtype) -> torch.Tensor:
    """S + outer(k, delta): k [HV, K, 1] or per value row [HV, K, V], delta [HV, 1, V]; rounded to the
    pool dtype and back (a no-op for fp32)."""
    return (S + k * delta).to(state_dtype).float()


def _replay(S: torch.Tensor, state: torch.Tensor, slot: int) -> torch.Tensor:
    """S [HV, K, V] advanced by the record in `slot`; each value row uses its own tile's k and decay."""
    tiles = _tiles(state, slot)
    dk, dv = state.shape[-1], state.shape[-2]
    per_row = lambda x: x.repeat_interleave(RECORD_ROWS, dim=1)[:, :dv]  # noqa: E731  [HV, tiles, ...] -> [HV, V, ...]
    k = per_row(tiles[:, :, :dk]).transpose(-1, -2)  # [HV, K, V]
    decay = per_row(tiles[:, :, dk + RECORD_ROWS])  # [HV, V]
    delta = tiles[:, :, dk:dk + RECORD_ROWS].reshape(tiles.shape[0], -1)[:, :dv]  # [HV, V]
    S = _decay(S, decay[:, None, :])
    return _add_update(S, k, delta[:, None, :], state.dtype)


def _base(state: torch.Tensor, row: list[int], a: int, use: bool) -> torch.Tensor:
    """The state the row's previous step committed: base idx[0] + records idx[1..a-1] (or zeros)."""
    S = _initial(state, row[0], use)
    if use and row[0] != PAD:
        for slot in row[1:min(max(a, 1), len(row))]:
            if slot != PAD:
                S = _replay(S, state, slot)
    return S


def _step(S: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
          scale: float, use_qk_l2norm: bool, state_dtype: torch.dtype
          ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """One token: S [HV, K, V] fp32, q and k [H, K], v [HV, V], g and beta [HV] -> (S rounded to
    state_dtype and back, o [HV, V] fp32, the token's record (k [HV, K], decay [HV], delta [HV, V])).
    No shape depends on the step."""
    qt, kt = _qk(q, k, v.shape[0], scale, use_qk_l2norm)  # [HV, K]
    decay = torch.exp(g.float())
    # S^T k and S^T q of the state before the token; the readout of the updated state is then
    # decay S^T q + delta (k . q)
    kv_mem = decay[:, None] * (S * kt[:, :, None]).sum(-2)  # [HV, V]
    qs = (S * qt[:, :, None]).sum(-2)
    delta = beta.float()[:, None] * (v.float() - kv_mem)
    S = _add_update(_decay(S, decay[:, None, None]), kt[:, :, None], delta[:, None, :], state_dtype)
    return S, decay[:, None] * qs + delta * (kt * qt).sum(-1)[:, None], (kt, decay, delta)


def recurrent_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   state: torch.Tensor, query_start_loc: torch.Tensor, state_idx: torch.Tensor,
                   num_accepted: torch.Tensor, has_initial_state: torch.Tensor | None, scale: float | None = None,
                   use_qk_l2norm: bool = True, records: bool = True) -> torch.Tensor:
    """The recurrence token after token, one per-token function for every kind of row.
    has_initial_state None: decode / verify rows (gated_delta_rule_update); else prefill rows of any
    length with gated_delta_rule_chunked's slots (initial state only where has_initial_state, the
    final state alone written, to idx[n, 0]), bit for bit the tokens' decode steps.
    records False: the layout before records (every token's full state to idx[n, t], the valid
    state read from idx[n, a-1]): gated_delta_rule_update_per_token, the tests' oracle."""
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
        if records:  # every read (base and records) before the first write
            S = _base(state, idx[n], acc[n], bool(init[n]))  # [HV, K, V]
        else:
            S = _initial(state, idx[n][max(acc[n], 1) - 1], bool(init[n]))
        for t in range(e - s0):
            i = s0 + t
            S, o, rec = _step(S, q[i], k[i], v[i], g[i], beta[i], scale, use_qk_l2norm, state.dtype)
            if has_initial_state is None and idx[n][t] != PAD:
                if t == 0 or not records:
                    _store(state, idx[n][t], S)
                else:
                    _write_record(state, idx[n][t], *rec)
            out[i] = o.to(v.dtype)
        if has_initial_state is not None:
            _store(state, idx[n][0], S)
    return out


def gated_delta_rule_update(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                            state: torch.Tensor, query_start_loc: torch.Tensor, state_idx: torch.Tensor,
                            num_accepted: torch.Tensor, scale: float | None = None,
                            use_qk_l2norm: bool = True) -> torch.Tensor:
    """Decode / verify rows, 1..1+k tokens each. q, k [ntok, H, K]; v [ntok, HV, V]; g, beta [ntok, HV]
    fp32; state [L, HV, V, K]. Per row: S = base idx[n, 0] + records idx[n, 1..a-1]; for each token t
    the recurrence of the module docstring; token 0's state to idx[n, 0], token t's record to idx[n, t]
    (t >= 1, skipped if PAD). The state is rounded to the pool dtype after every token (a no-op for
    fp32), so a row of T tokens equals T single-token calls bit for bit. Returns o [ntok, HV, V] in v's
    dtype (zeros for PAD rows)."""
    return recurrent_rows(q, k, v, g, beta, state, query_start_loc, state_idx, num_accepted, None, scale,
                          use_qk_l2norm)


def gated_delta_rule_update_per_token(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                      beta: torch.Tensor, state: torch.Tensor, query_start_loc: torch.Tensor,
                                      state_idx: torch.Tensor, num_accepted: torch.Tensor) -> torch.Tensor:
    """The layout before records: S = state[idx[n, a-1]], every token's full state to idx[n, t]. Not
    used by the engine; the oracle the record layout equals bit for bit (outputs and committed states)."""
    return recurrent_rows(q, k, v, g, beta, state, query_start_loc, state_idx, num_accepted, None, records=False)


def gated_delta_rule_materialise(state: torch.Tensor, state_idx: torch.Tensor, num_accepted: torch.Tensor,
                                 dst: torch.Tensor) -> None:
    """state[dst[n]] = the state after a = num_accepted[n] tokens of the step that wrote slot row
    state_idx[n] (base idx[n, 0] replayed with records idx[n, 1..a-1]), the bits the next step starts
    from. Rows whose base or dst is PAD are skipped. Every read happens before the first write."""
    rows, acc, dsts = _lists(state_idx, num_accepted, dst)
    done = [(d, _base(state, row, a, True)) for row, a, d in zip(rows, acc, dsts) if row[0] != PAD and d != PAD]
    for d, S in done:
        _store(state, d, S)


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
    gated_delta_rule_update within fp32 rounding. Initial state: base idx[n, 0] + records idx[n, 1..a-1]
    when has_initial_state[n], else zeros. The final state is written to state[idx[n, 0]] (a = 1 for the
    next step). Shapes as gated_delta_rule_update. Returns o [ntok, HV, V] in v's dtype."""
    num_v_heads = v.shape[1]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out = torch.zeros_like(v)
    qsl, idx, acc, init = _lists(query_start_loc, state_idx, num_accepted, has_initial_state)
    for n in range(len(qsl) - 1):
        s0, e = qsl[n], qsl[n + 1]
        if idx[n][0] == PAD or e == s0:
            continue
        S = _base(state, idx[n], acc[n], bool(init[n]))
        qh, kh = _qk(q[s0:e], k[s0:e], num_v_heads, scale, use_qk_l2norm)  # [T, HV, K]
        heads_first = [x.transpose(0, 1) for x in (qh, kh, v[s0:e].float(), g[s0:e].float(), beta[s0:e].float())]
        o, S = _chunk_scan(*heads_first, S, chunk_size)
        _store(state, idx[n][0], S)
        out[s0:e] = o.transpose(0, 1).to(v.dtype)
    return out
