"""The Gated DeltaNet references (pyengine/ops/reference/gdn.py): the recurrent update against HF's
torch_recurrent_gated_delta_rule (grouped heads, varlen rows, initial states), the slot conventions
(read idx[n, a-1], each token writes its own slot, PAD rows inert), a verify row == single-token calls
bit for bit, and the chunked prefill form against the recurrence and HF's torch_chunk_gated_delta_rule."""
from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_next import modeling_qwen3_next as hf

from pyengine.ops.reference import gdn as ref

PAD = ref.PAD
H, HV, DK, DV = 2, 4, 16, 24  # q/k heads, value heads, key dim, value dim
# the torch paths, even where a hub kernel or FLA would be picked
HF_RECURRENT = getattr(hf.torch_recurrent_gated_delta_rule, "__wrapped__", hf.torch_recurrent_gated_delta_rule)
HF_CHUNK = getattr(hf.torch_chunk_gated_delta_rule, "__wrapped__", hf.torch_chunk_gated_delta_rule)


def inputs(ntok: int, gen: torch.Generator, dtype: torch.dtype = torch.float32) -> dict:
    a, b = torch.randn(ntok, HV, generator=gen), torch.randn(ntok, HV, generator=gen)
    a_log, dt_bias = torch.rand(HV, generator=gen), torch.randn(HV, generator=gen)
    return {"q": torch.randn(ntok, H, DK, generator=gen).to(dtype),
            "k": torch.randn(ntok, H, DK, generator=gen).to(dtype),
            "v": torch.randn(ntok, HV, DV, generator=gen).to(dtype),
            "g": -a_log.exp() * torch.nn.functional.softplus(a + dt_bias),
            "beta": torch.sigmoid(b)}


def pool(num_slots: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(num_slots, HV, DV, DK, generator=gen)  # the pool's [HV, V, K] layout


def qsl_of(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0] + lengths).cumsum(0).to(torch.int32)


def i32(x) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.int32)


def update(x: dict, state, lengths, idx, acc) -> torch.Tensor:
    return ref.gated_delta_rule_update(x["q"], x["k"], x["v"], x["g"], x["beta"], state, qsl_of(lengths), i32(idx),
                                       i32(acc))


def chunked(x: dict, state, lengths, idx, acc, init, chunk_size) -> torch.Tensor:
    return ref.gated_delta_rule_chunked(x["q"], x["k"], x["v"], x["g"], x["beta"], qsl_of(lengths), state, i32(idx),
                                        i32(acc), i32(init), chunk_size=chunk_size)


def hf_row(fn, x: dict, s: int, e: int, init: torch.Tensor | None, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """One row through an HF oracle: [T, ...] -> [1, T, ...]; returns (o [T, HV, V], final state in
    the pool's [HV, V, K] layout; HF's is [HV, K, V])."""
    o, fin = fn(*(x[n][s:e][None] for n in ("q", "k", "v", "g", "beta")), initial_state=None if init is None
                else init.transpose(-1, -2)[None].contiguous(), output_final_state=True, use_qk_l2norm_in_kernel=True,
                **kw)
    return o[0], fin[0].transpose(-1, -2)


def close(a: torch.Tensor, b: torch.Tensor, rtol: float = 1e-4) -> None:
    tol = rtol * max(1.0, b.abs().max().item())
    assert (a.float() - b.float()).abs().max().item() <= tol


def test_update_matches_hf_recurrent():
    gen = torch.Generator().manual_seed(0)
    lengths, k = [1, 4, 2, 3], 3
    x, state = inputs(sum(lengths), gen), pool(16, gen)
    idx = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, PAD, PAD], [10, 11, 12, 13]]
    acc = [1, 3, 2, 4]
    before = state.clone()
    out = update(x, state, lengths, idx, acc)
    qsl = qsl_of(lengths).tolist()
    for n, (row, a) in enumerate(zip(idx, acc)):
        o, fin = hf_row(HF_RECURRENT, x, qsl[n], qsl[n + 1], before[row[a - 1]])
        close(out[qsl[n]:qsl[n + 1]], o, 1e-5)
        close(state[row[lengths[n] - 1]], fin, 1e-5)
    assert len(idx[0]) == 1 + k


def test_acceptance_reads_slot_a_minus_1():
    gen = torch.Generator().manual_seed(1)
    k = 3
    x, base = inputs(1, gen), pool(1 + k, gen)  # a different state in every slot
    outs = []
    for a in range(1, 2 + k):
        state = base.clone()
        out = update(x, state, [1], [list(range(1 + k))], [a])
        o, fin = hf_row(HF_RECURRENT, x, 0, 1, base[a - 1])
        close(out, o, 1e-5)
        close(state[0], fin, 1e-5)  # one token: written to slot idx[n, 0]
        assert torch.equal(state[1:], base[1:])  # the other slots are only read
        outs.append(out)
    for i in range(len(outs)):  # each slot gives a different output: the test can tell which was read
        assert all(not torch.allclose(outs[i], outs[j]) for j in range(i))
    # a = 0 is clamped to 1
    state = base.clone()
    assert torch.equal(update(x, state, [1], [list(range(1 + k))], [0]), outs[0])


def test_every_token_writes_its_own_slot_and_pad_rows_are_inert():
    gen = torch.Generator().manual_seed(2)
    lengths = [3, 2, 2, 1]
    x, state = inputs(sum(lengths), gen), pool(12, gen)
    idx = [[5, 2, 7], [PAD, PAD, PAD], [0, PAD, 3], [PAD, 1, 4]]
    acc = [2, 1, 3, 2]
    before = state.clone()
    out = update(x, state, lengths, idx, acc)
    qsl = qsl_of(lengths).tolist()
    o, _ = hf_row(HF_RECURRENT, x, 0, 3, before[2])
    close(out[0:3], o, 1e-5)
    for t, slot in enumerate(idx[0]):  # the state after token t is in slot idx[0, t]
        _, fin = hf_row(HF_RECURRENT, x, 0, t + 1, before[2])
        close(state[slot], fin, 1e-5)
    # row 2: reads slot 3 (a = 3), writes slot 0 after token 0, nothing after token 1 (PAD)
    o, fin = hf_row(HF_RECURRENT, x, qsl[2], qsl[3], before[3])
    close(out[qsl[2]:qsl[3]], o, 1e-5)
    _, fin0 = hf_row(HF_RECURRENT, x, qsl[2], qsl[2] + 1, before[3])
    close(state[0], fin0, 1e-5)
    # PAD rows (first slot PAD) output zeros and write nothing, even where later slots are not PAD
    assert torch.equal(out[qsl[1]:qsl[2]], torch.zeros_like(out[qsl[1]:qsl[2]]))
    assert torch.equal(out[qsl[3]:qsl[4]], torch.zeros_like(out[qsl[3]:qsl[4]]))
    untouched = [s for s in range(12) if s not in (5, 2, 7, 0)]
    assert torch.equal(state[untouched], before[untouched])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_verify_row_equals_single_token_calls_bitwise(dtype):
    gen = torch.Generator().manual_seed(3)
    lengths = [2, 4, 1, 3]  # row 1 is the verify row under test; the others share the call
    x, base = inputs(sum(lengths), gen, dtype), pool(16, gen)
    idx = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    acc = [2, 3, 1, 4]
    batched = base.clone()
    out = update(x, batched, lengths, idx, acc)
    qsl = qsl_of(lengths).tolist()
    single, outs = base.clone(), []
    for n in range(len(lengths)):
        for t in range(lengths[n]):
            i = qsl[n] + t
            tok = {name: val[i:i + 1] for name, val in x.items()}
            # token 0 reads idx[n, a-1]; token t > 0 reads the slot token t - 1 wrote (a = 2 of [dst, src])
            row, a = (idx[n], acc[n]) if t == 0 else ([idx[n][t], idx[n][t - 1]], 2)
            outs.append(update(tok, single, [1], [row], [a]))
    assert torch.equal(out, torch.cat(outs))
    assert torch.equal(batched, single)
    # alone in the call as well
    alone = base.clone()
    assert torch.equal(update({n: val[qsl[1]:qsl[2]] for n, val in x.items()}, alone, [4], [idx[1]], [acc[1]]),
                       out[qsl[1]:qsl[2]])
    assert torch.equal(alone[idx[1]], batched[idx[1]])


@pytest.mark.parametrize("chunk_size", [64, 16])
@pytest.mark.parametrize("with_init", [False, True])
def test_chunked_matches_recurrent_and_hf(chunk_size, with_init):
    gen = torch.Generator().manual_seed(4 + chunk_size + with_init)
    lengths = [1, 5, 64, 65, 150]
    x, base = inputs(sum(lengths), gen), pool(2 * len(lengths), gen)
    idx = [[2 * n, 2 * n + 1] for n in range(len(lengths))]
    acc = [2, 1, 2, 1, 2]  # initial states from slot idx[n, a-1]
    init = [int(with_init)] * len(lengths)
    state = base.clone()
    out = chunked(x, state, lengths, idx, acc, init, chunk_size)
    qsl = qsl_of(lengths).tolist()
    for n, (row, a) in enumerate(zip(idx, acc)):
        s, e = qsl[n], qsl[n + 1]
        s_init = base[row[a - 1]] if with_init else None
        # the recurrence, token by token through gated_delta_rule_update (slot 0 of a scratch pool)
        scratch = (s_init if with_init else torch.zeros_like(base[0]))[None].clone()
        rec = torch.cat([update({nm: val[i:i + 1] for nm, val in x.items()}, scratch, [1], [[0]], [1])
                         for i in range(s, e)])
        close(out[s:e], rec)
        close(state[row[0]], scratch[0])  # final state written to idx[n, 0]
        o, fin = hf_row(HF_CHUNK, x, s, e, s_init, chunk_size=chunk_size)
        close(out[s:e], o)
        close(state[row[0]], fin)
        if a == 2:  # the source slot idx[n, 1] is only read
            assert torch.equal(state[row[1]], base[row[1]])


def test_chunked_mixed_rows_and_pad():
    gen = torch.Generator().manual_seed(5)
    lengths = [7, 3, 20]
    x, base = inputs(sum(lengths), gen), pool(6, gen)
    idx, acc, init = [[0, 1], [PAD, 2], [3, 4]], [2, 1, 2], [1, 1, 0]
    state = base.clone()
    out = chunked(x, state, lengths, idx, acc, init, 8)
    qsl = qsl_of(lengths).tolist()
    o, fin = hf_row(HF_RECURRENT, x, 0, 7, base[1])
    close(out[:7], o)
    close(state[0], fin)
    o, fin = hf_row(HF_RECURRENT, x, qsl[2], qsl[3], None)  # no initial state: slot 4 is not read
    close(out[qsl[2]:], o)
    close(state[3], fin)
    assert torch.equal(out[qsl[1]:qsl[2]], torch.zeros_like(out[qsl[1]:qsl[2]]))
    assert torch.equal(state[[1, 2, 4, 5]], base[[1, 2, 4, 5]])
