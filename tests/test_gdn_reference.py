"""The Gated DeltaNet references (pyengine/ops/reference/gdn.py): the recurrent update against HF's
torch_recurrent_gated_delta_rule (grouped heads, varlen rows, initial states); the slot layout (base
state in idx[n, 0], a record per later token in idx[n, t], replayed on the next step) equal bit for
bit to the layout before records (every token's full state in its own slot: the oracle
gated_delta_rule_update_per_token) over multi-step acceptance sequences, every a, PAD rows, partial
record tiles, prefill rows (reference and CPU) and checkpoint materialisation; a verify row ==
single-token calls bit for bit; the chunked prefill form against the recurrence and HF's
torch_chunk_gated_delta_rule."""
from __future__ import annotations

import random

import pytest
import torch
from transformers.models.qwen3_next import modeling_qwen3_next as hf

from pyengine import ops
from pyengine.ops.cpu import gdn as cpu_gdn
from pyengine.ops.reference import gdn as ref

PAD = ref.PAD
H, HV, DK, DV = 2, 4, 16, 24  # q/k heads, value heads, key dim, value dim
# the torch paths, even where a hub kernel or FLA would be picked
HF_RECURRENT = getattr(hf.torch_recurrent_gated_delta_rule, "__wrapped__", hf.torch_recurrent_gated_delta_rule)
HF_CHUNK = getattr(hf.torch_chunk_gated_delta_rule, "__wrapped__", hf.torch_chunk_gated_delta_rule)


def inputs(ntok: int, gen: torch.Generator, dtype: torch.dtype = torch.float32, dims=(H, HV, DK, DV)) -> dict:
    h, hv, dk, dv = dims
    a, b = torch.randn(ntok, hv, generator=gen), torch.randn(ntok, hv, generator=gen)
    a_log, dt_bias = torch.rand(hv, generator=gen), torch.randn(hv, generator=gen)
    return {"q": torch.randn(ntok, h, dk, generator=gen).to(dtype),
            "k": torch.randn(ntok, h, dk, generator=gen).to(dtype),
            "v": torch.randn(ntok, hv, dv, generator=gen).to(dtype),
            "g": -a_log.exp() * torch.nn.functional.softplus(a + dt_bias),
            "beta": torch.sigmoid(b)}


def pool(num_slots: int, gen: torch.Generator, dims=(H, HV, DK, DV)) -> torch.Tensor:
    return torch.randn(num_slots, dims[1], dims[3], dims[2], generator=gen)  # the pool's [HV, V, K] layout


def qsl_of(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0] + lengths).cumsum(0).to(torch.int32)


def i32(x) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.int32)


def update(x: dict, state, lengths, idx, acc, fn=ref.gated_delta_rule_update) -> torch.Tensor:
    return fn(x["q"], x["k"], x["v"], x["g"], x["beta"], state, qsl_of(lengths), i32(idx), i32(acc))


def chunked(x: dict, state, lengths, idx, acc, init, chunk_size, fn=ref.gated_delta_rule_chunked) -> torch.Tensor:
    return fn(x["q"], x["k"], x["v"], x["g"], x["beta"], qsl_of(lengths), state, i32(idx), i32(acc), i32(init),
              chunk_size=chunk_size)


def committed(state: torch.Tensor, row: list[int], a: int) -> torch.Tensor:
    """The full state a row committed (base + a - 1 records), materialised into a scratch copy."""
    scratch = torch.cat([state, state[:1]])
    ref.gated_delta_rule_materialise(scratch, i32([row]), i32([a]), i32([state.shape[0]]))
    assert torch.equal(scratch[:-1], state)  # only dst is written
    return scratch[-1]


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
    before = state.clone()
    out = update(x, state, lengths, idx, [1] * 4)  # a = 1: every row starts from its base idx[n, 0]
    qsl = qsl_of(lengths).tolist()
    for n, row in enumerate(idx):
        o, fin = hf_row(HF_RECURRENT, x, qsl[n], qsl[n + 1], before[row[0]])
        close(out[qsl[n]:qsl[n + 1]], o, 1e-5)
        close(committed(state, row, lengths[n]), fin, 1e-5)
        for t in range(lengths[n]):  # the state after every token is base + records
            close(committed(state, row, t + 1), hf_row(HF_RECURRENT, x, qsl[n], qsl[n] + t + 1, before[row[0]])[1],
                  1e-5)
    assert len(idx[0]) == 1 + k


def test_base_in_slot_0_records_in_the_others_pad_rows_inert():
    gen = torch.Generator().manual_seed(2)
    lengths = [3, 2, 2, 1]
    x, state = inputs(sum(lengths), gen), pool(12, gen)
    idx = [[5, 2, 7], [PAD, PAD, PAD], [0, PAD, 3], [PAD, 1, 4]]
    before = state.clone()
    out = update(x, state, lengths, idx, [1, 1, 1, 1])
    qsl = qsl_of(lengths).tolist()
    _, fin0 = hf_row(HF_RECURRENT, x, 0, 1, before[5])
    close(state[5], fin0, 1e-5)  # token 0: the full state, in idx[n, 0]
    tiles = ref._tiles(state, 2)  # token 1: a record in idx[n, 1], not a state
    k1 = torch.nn.functional.normalize(x["k"][1].float(), dim=-1, eps=0).repeat_interleave(HV // H, 0)
    close(tiles[:, 0, :DK], k1, 1e-5)
    assert torch.equal(tiles[:, 0, DK + ref.RECORD_ROWS], torch.exp(x["g"][1]))
    assert torch.equal(state[2].reshape(HV, -1)[:, ref.record_width(DK):], before[2].reshape(HV, -1)[:, ref.record_width(DK):])
    # row 2: token 1's slot is PAD, nothing written there
    close(state[0], hf_row(HF_RECURRENT, x, qsl[2], qsl[2] + 1, before[0])[1], 1e-5)
    # PAD rows (first slot PAD) output zeros and write nothing, even where later slots are not PAD
    assert torch.equal(out[qsl[1]:qsl[2]], torch.zeros_like(out[qsl[1]:qsl[2]]))
    assert torch.equal(out[qsl[3]:qsl[4]], torch.zeros_like(out[qsl[3]:qsl[4]]))
    untouched = [s for s in range(12) if s not in (5, 2, 7, 0)]
    assert torch.equal(state[untouched], before[untouched])


@pytest.mark.parametrize("dims", [(H, HV, DK, DV), (1, 3, 8, 40)], ids=["one_partial_tile", "two_tiles"])
def test_records_equal_per_token_states_over_steps(dims):
    """Several steps of verify rows with every acceptance length: outputs and committed states of the
    record layout equal the per-token layout's bit for bit."""
    gen, rng = torch.Generator().manual_seed(7), random.Random(7)
    slots_per_row, rows = 4, 5
    perm = torch.randperm(rows * slots_per_row, generator=gen).tolist()
    idx = [perm[n * slots_per_row:(n + 1) * slots_per_row] for n in range(rows)]
    idx[3] = [PAD] * slots_per_row  # a PAD row
    old = pool(rows * slots_per_row, gen, dims)
    new, acc = old.clone(), [1] * rows
    seen = set()
    for step in range(8):
        lengths = [slots_per_row if n % 2 == 0 else rng.randint(1, slots_per_row) for n in range(rows)]
        x = inputs(sum(lengths), gen, dims=dims)
        out_old = update(x, old, lengths, idx, acc, ref.gated_delta_rule_update_per_token)
        out_new = update(x, new, lengths, idx, acc)
        assert torch.equal(out_old, out_new), f"step {step}"
        acc = [1 + (step + n) % q if n % 2 == 0 else rng.randint(1, q) for n, q in enumerate(lengths)]
        for n, row in enumerate(idx):
            if row[0] != PAD:
                assert torch.equal(committed(new, row, acc[n]), old[row[acc[n] - 1]]), f"step {step} row {n}"
                seen.add((lengths[n], acc[n]))
    assert {(4, a) for a in range(1, 5)} <= seen


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_prefill_after_records_equals_per_token(backend: str):
    """A prefill row (recurrent CPU form: bit for bit; chunked reference form: from the same initial
    bits) starts from base + a - 1 records and writes its final state to idx[n, 0]."""
    gen = torch.Generator().manual_seed(8)
    idx = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    old = pool(12, gen)
    new = old.clone()
    x = inputs(12, gen)
    update(x, old, [4, 4, 4], idx, [1, 1, 1], ref.gated_delta_rule_update_per_token)
    update(x, new, [4, 4, 4], idx, [1, 1, 1])
    acc, init, lengths = [3, 4, 2], [1, 1, 0], [5, 9, 3]
    y = inputs(sum(lengths), gen)
    if backend == "cpu":
        got = chunked(y, new, lengths, idx, acc, init, 4, cpu_gdn.gated_delta_rule_chunked)
        want = ref.recurrent_rows(y["q"], y["k"], y["v"], y["g"], y["beta"], old, qsl_of(lengths), i32(idx), i32(acc),
                                  i32(init), records=False)
    else:  # the per-token layout's committed state moved to idx[n, 0], read with a = 1
        for row, a in zip(idx, acc):
            old[row[0]] = old[row[a - 1]].clone()
        got = chunked(y, new, lengths, idx, acc, init, 4)
        want = chunked(y, old, lengths, idx, [1, 1, 1], init, 4)
    assert torch.equal(got, want)
    assert all(torch.equal(new[row[0]], old[row[0]]) for row in idx)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_verify_row_equals_single_token_calls_bitwise(dtype):
    gen = torch.Generator().manual_seed(3)
    lengths = [2, 4, 1, 3]  # row 1 is the verify row under test; the others share the call
    x, base = inputs(sum(lengths), gen, dtype), pool(16, gen)
    idx = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    acc = [1, 1, 1, 1]
    batched = base.clone()
    out = update(x, batched, lengths, idx, acc)
    qsl = qsl_of(lengths).tolist()
    single, outs = base.clone(), []
    for n in range(len(lengths)):
        for t in range(lengths[n]):  # one token per call, each committing its token into the base slot
            i = qsl[n] + t
            outs.append(update({name: val[i:i + 1] for name, val in x.items()}, single, [1], [idx[n]], [1]))
        assert torch.equal(committed(batched, idx[n], lengths[n]), single[idx[n][0]])
    assert torch.equal(out, torch.cat(outs))
    # alone in the call as well
    alone = base.clone()
    assert torch.equal(update({n: val[qsl[1]:qsl[2]] for n, val in x.items()}, alone, [4], [idx[1]], [acc[1]]),
                       out[qsl[1]:qsl[2]])
    assert torch.equal(alone[idx[1]], batched[idx[1]])


def test_materialise_facade_and_records_fit():
    gen = torch.Generator().manual_seed(9)
    state = pool(6, gen)
    x = inputs(3, gen)
    update(x, state, [3], [[0, 1, 2]], [1])
    before = state.clone()
    ops.gated_delta_rule_materialise(state, i32([[0, 1, 2], [PAD, 1, 2]]), i32([3, 2]), i32([4, 5]))
    assert torch.equal(state[4], committed(before, [0, 1, 2], 3))
    assert torch.equal(state[:4], before[:4]) and torch.equal(state[5], before[5])  # PAD base: nothing
    assert ref.records_fit(128, 128) and not ref.records_fit(4, 2)
    with pytest.raises(ValueError, match="records"):
        ops.gated_delta_rule_materialise(torch.zeros(2, 1, 2, 4), i32([[0]]), i32([1]), i32([1]))


@pytest.mark.parametrize("chunk_size", [64, 16])
@pytest.mark.parametrize("with_init", [False, True])
def test_chunked_matches_recurrent_and_hf(chunk_size, with_init):
    gen = torch.Generator().manual_seed(4 + chunk_size + with_init)
    lengths = [1, 5, 64, 65, 150]
    x, base = inputs(sum(lengths), gen), pool(2 * len(lengths), gen)
    idx = [[2 * n, 2 * n + 1] for n in range(len(lengths))]
    acc = [1] * len(lengths)  # initial states from the base slot idx[n, 0]
    init = [int(with_init)] * len(lengths)
    state = base.clone()
    out = chunked(x, state, lengths, idx, acc, init, chunk_size)
    qsl = qsl_of(lengths).tolist()
    for n, row in enumerate(idx):
        s, e = qsl[n], qsl[n + 1]
        s_init = base[row[0]] if with_init else None
        # the recurrence, token by token through gated_delta_rule_update (slot 0 of a scratch pool)
        scratch = (s_init if with_init else torch.zeros_like(base[0]))[None].clone()
        rec = torch.cat([update({nm: val[i:i + 1] for nm, val in x.items()}, scratch, [1], [[0]], [1])
                         for i in range(s, e)])
        close(out[s:e], rec)
        close(state[row[0]], scratch[0])  # final state written to idx[n, 0]
        o, fin = hf_row(HF_CHUNK, x, s, e, s_init, chunk_size=chunk_size)
        close(out[s:e], o)
        close(state[row[0]], fin)
        assert torch.equal(state[row[1]], base[row[1]])  # the record slot is not touched


def test_chunked_mixed_rows_and_pad():
    gen = torch.Generator().manual_seed(5)
    lengths = [7, 3, 20]
    x, base = inputs(sum(lengths), gen), pool(6, gen)
    idx, acc, init = [[0, 1], [PAD, 2], [3, 4]], [1, 1, 2], [1, 1, 0]
    state = base.clone()
    out = chunked(x, state, lengths, idx, acc, init, 8)
    qsl = qsl_of(lengths).tolist()
    o, fin = hf_row(HF_RECURRENT, x, 0, 7, base[0])
    close(out[:7], o)
    close(state[0], fin)
    o, fin = hf_row(HF_RECURRENT, x, qsl[2], qsl[3], None)  # no initial state: slots 3, 4 are not read
    close(out[qsl[2]:], o)
    close(state[3], fin)
    assert torch.equal(out[qsl[1]:qsl[2]], torch.zeros_like(out[qsl[1]:qsl[2]]))
    assert torch.equal(state[[1, 2, 4, 5]], base[[1, 2, 4, 5]])
