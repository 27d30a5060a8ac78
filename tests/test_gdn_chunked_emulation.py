"""A PyTorch emulation shaped exactly like the chunked Gated DeltaNet prefill kernel
(hipkernels/ssm/gdn_chunked_prefill.hip) against the per-token recurrence of
pyengine/ops/reference/gdn.py, on the CPU in fp32. The emulation follows the kernel's blocking: one
(row, value head, tile of value columns) at a time, chunks of `chunk` tokens (the last one padded
with k = q = v = g = beta = 0), the intra-chunk matrices, the forward substitution token after token,
the readout and one state update per chunk. If this passes, the kernel's algorithm is right; the GPU
tests (tests/test_gdn_chunked_prefill_gpu.py) then check its implementation."""
from __future__ import annotations

import pytest
import torch

from pyengine.ops import reference

PAD = -1


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def _tile_scan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               S: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The blocks of one row and one value tile, all value heads at once (they are independent):
    q, k [HV, T, K] (normalised, q scaled); v [HV, T, BV]; g, beta [HV, T]; S [HV, K, BV] (the tile
    of S = pool^T) -> (o [HV, T, BV], final S)."""
    outs = []
    causal = torch.ones(chunk, chunk, dtype=torch.bool).tril()
    for c0 in range(0, q.shape[1], chunk):
        n = min(chunk, q.shape[1] - c0)

        def fill(x: torch.Tensor) -> torch.Tensor:  # the kernel zero-fills the tail of the last chunk
            pad = x.new_zeros((x.shape[0], chunk - n) + x.shape[2:])
            return torch.cat([x[:, c0:c0 + n], pad], dim=1)

        Kc, Qc, Vc, gc, bc = fill(k), fill(q), fill(v), fill(g), fill(beta)
        cum = gc.cumsum(-1)  # [HV, C]
        # exp(cum_t - cum_s) for s <= t only: never above 1, no division by a decayed G_s
        decay = (cum[:, :, None] - cum[:, None, :]).masked_fill(~causal, float("-inf")).exp()
        A = (bc[:, :, None] * (Kc @ Kc.mT) * decay).tril(-1)  # strictly lower
        M = (Qc @ Kc.mT) * decay                               # lower with the diagonal
        KS, QS = Kc @ S, Qc @ S                                # [HV, C, BV]: S0^T k_t, S0^T q_t
        rhs = bc[:, :, None] * (Vc - cum.exp()[:, :, None] * KS)
        U = torch.zeros_like(rhs)
        for t in range(chunk):  # (I + A) U = rhs by forward substitution, token after token
            U[:, t] = rhs[:, t] - (A[:, t, None, :t] @ U[:, :t]).squeeze(1)
        o = cum.exp()[:, :, None] * QS + M @ U
        to_end = (cum[:, -1:] - cum).exp()  # decay from token s to the chunk's end
        S = cum[:, -1, None, None].exp() * S + (Kc * to_end[:, :, None]).mT @ U
        outs.append(o[:, :n])
    return torch.cat(outs, dim=1), S


def kernel_shaped_prefill(q, k, v, g, beta, state, query_start_loc, state_idx, has_initial_state, scale: float,
                          l2norm: bool, chunk: int = 64, tile: int = 32) -> torch.Tensor:
    """The kernel's semantics (gdn_chunked_prefill.h) with its blocking: returns out, updates state."""
    HV, V = v.shape[1], v.shape[2]
    rep = HV // q.shape[1]
    out = torch.zeros(v.shape, dtype=torch.float32)
    qsl, idx, init = query_start_loc.tolist(), state_idx[:, 0].tolist(), has_initial_state.tolist()
    for n in range(len(qsl) - 1):
        s0, e = qsl[n], qsl[n + 1]
        if idx[n] == PAD or e == s0:
            continue
        qh, kh = q[s0:e].float(), k[s0:e].float()
        if l2norm:
            qh, kh = _l2norm(qh), _l2norm(kh)
        qh = qh * scale
        # key head hv // rep for value head hv; heads first
        qh, kh = (x.repeat_interleave(rep, dim=1).transpose(0, 1) for x in (qh, kh))
        gh, bh, vh = g[s0:e].float().T, beta[s0:e].float().T, v[s0:e].float().transpose(0, 1)
        for v0 in range(0, V, tile):  # one block per (value head, tile of value columns)
            cols = slice(v0, min(v0 + tile, V))
            S = state[idx[n], :, cols].mT.clone() if init[n] else torch.zeros(HV, k.shape[-1], cols.stop - v0)
            o, S = _tile_scan(qh, kh, vh[:, :, cols], gh, bh, S, chunk)
            out[s0:e, :, cols] = o.transpose(0, 1)
            state[idx[n], :, cols] = S.mT
    return out.to(v.dtype)


def per_token_prefill(q, k, v, g, beta, state, query_start_loc, state_idx, has_initial_state, scale: float,
                      l2norm: bool) -> torch.Tensor:
    """The spec: the reference decode step (gated_delta_rule_update), one token at a time, each row
    reading and writing its slot state_idx[n, 0] (zeroed first where it has no initial state)."""
    out = torch.zeros_like(v)
    qsl, idx = query_start_loc.tolist(), state_idx[:, 0].tolist()
    one, row = torch.tensor([0, 1], dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    for n in range(len(qsl) - 1):
        if idx[n] == PAD or qsl[n + 1] == qsl[n]:
            continue
        if not bool(has_initial_state[n]):
            state[idx[n]] = 0
        for i in range(qsl[n], qsl[n + 1]):
            out[i:i + 1] = reference.gated_delta_rule_update(
                q[i:i + 1], k[i:i + 1], v[i:i + 1], g[i:i + 1], beta[i:i + 1], state, one,
                torch.tensor([[idx[n]]], dtype=torch.int32), row, scale, l2norm)
    return out


def make_inputs(lengths: list[int], h: int = 2, hv: int = 4, dk: int = 16, dv: int = 24, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    ntok = sum(lengths)
    rnd = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    return {"q": rnd(ntok, h, dk), "k": rnd(ntok, h, dk), "v": rnd(ntok, hv, dv),
            "g": -torch.nn.functional.softplus(rnd(ntok, hv)) * 0.5, "beta": torch.sigmoid(rnd(ntok, hv)),
            "query_start_loc": torch.tensor([0] + lengths).cumsum(0).to(torch.int32)}


def run(fn, x: dict, state: torch.Tensor, idx: list[int], init: list[bool], **kw) -> torch.Tensor:
    return fn(x["q"], x["k"], x["v"], x["g"], x["beta"], state, x["query_start_loc"],
              torch.tensor(idx, dtype=torch.int32)[:, None], torch.tensor(init), x["q"].shape[-1] ** -0.5, True, **kw)


def pool(slots: int, hv: int = 4, dv: int = 24, dk: int = 16) -> torch.Tensor:
    return torch.randn(slots, hv, dv, dk, generator=torch.Generator().manual_seed(7)) * 0.5


@pytest.mark.parametrize("length", [1, 63, 64, 65, 130])
@pytest.mark.parametrize("init", [False, True])
def test_emulation_equals_recurrence(length: int, init: bool) -> None:
    """Grouped heads (2 key heads, 4 value heads), l2norm on, 3 value tiles of 8 columns."""
    x = make_inputs([length], seed=length)
    got_state, ref_state = pool(2), pool(2)
    got = run(kernel_shaped_prefill, x, got_state, [1], [init], chunk=64, tile=8)
    ref = run(per_token_prefill, x, ref_state, [1], [init])
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got_state, ref_state, atol=1e-4, rtol=1e-4)


def test_emulation_rows_pad_and_smaller_chunks() -> None:
    """Several rows, a PAD row (zero output, no state written), an empty row, the chunk of the hipcc
    build (32) and a value tile that does not divide V."""
    lengths, idx, init = [70, 5, 33, 0, 100], [0, PAD, 2, 3, 4], [True, True, False, True, True]
    x = make_inputs(lengths, seed=3)
    base = pool(6)
    ref_state = base.clone()
    ref = run(per_token_prefill, x, ref_state, idx, init)
    for chunk in (64, 32):
        got_state = base.clone()
        got = run(kernel_shaped_prefill, x, got_state, idx, init, chunk=chunk, tile=16)
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(got_state, ref_state, atol=1e-4, rtol=1e-4)
        assert (got[70:75] == 0).all()
        assert torch.equal(got_state[3], base[3]) and torch.equal(got_state[5], base[5])  # empty row, unused slot


def test_emulation_sees_one_changed_gate() -> None:
    """The comparison can fail: one token's gate changed moves every later output, no earlier one."""
    x = make_inputs([100], seed=4)
    ref = run(per_token_prefill, x, torch.zeros(1, 4, 24, 16), [0], [False])
    x["g"] = x["g"].clone()
    x["g"][50] -= 1.0
    got = run(kernel_shaped_prefill, x, torch.zeros(1, 4, 24, 16), [0], [False])
    torch.testing.assert_close(got[:50], ref[:50], atol=1e-4, rtol=1e-4)
    assert not torch.allclose(got[50:], ref[50:], atol=1e-3)
