"""Reference paged attention and KV write (through the ops facade) against a naive per-row dense
float64 oracle, and the facade's validation."""
from __future__ import annotations

import random

import pytest
import torch

from pyengine import ops
from pyengine.ops import reference
from tests.utils_paged import make_meta


def _dense_oracle(q, k_rows, v_rows, q_lens, scale):
    """Per row: causal attention of the last q_len positions over the row's full K/V (float64)."""
    outs, lses = [], []
    start = 0
    for k, v, q_len in zip(k_rows, v_rows, q_lens):
        ctx = k.shape[0]
        group = q.shape[1] // k.shape[1]
        kk = k.repeat_interleave(group, dim=1)  # [ctx, Hq, D]
        vv = v.repeat_interleave(group, dim=1)
        for i in range(q_len):
            limit = ctx - (q_len - 1 - i)
            s = torch.einsum("hd,khd->hk", q[start + i], kk[:limit]) * scale
            lses.append(torch.logsumexp(s, dim=-1))
            outs.append(torch.einsum("hk,khd->hd", torch.softmax(s, dim=-1), vv[:limit]))
        start += q_len
    if not outs:
        return q.new_zeros(q.shape), q.new_zeros(q.shape[:2])
    return torch.stack(outs), torch.stack(lses)


def _run_case(seed, hq, hkv, d, block_size, rows_spec, dtype=torch.float64):
    """rows_spec: list of (context_len_before, q_len)."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    blocks_needed = sum(-(-(c + q) // block_size) for c, q in rows_spec) + 3
    free = list(range(blocks_needed))
    rng.shuffle(free)  # permuted block tables
    shape = (blocks_needed, block_size, hkv, d)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)  # unused pages are NaN
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    rows, k_rows, v_rows = [], [], []
    new_k, new_v = [], []
    for cached, q_len in rows_spec:
        table = [free.pop() for _ in range(-(-(cached + q_len) // block_size))]
        k = torch.randn(cached + q_len, hkv, d, generator=gen, dtype=dtype)
        v = torch.randn(cached + q_len, hkv, d, generator=gen, dtype=dtype)
        # The already-cached prefix is written through a previous "step".
        if cached:
            meta_prev, _ = make_meta([(table, 0, cached)], block_size)
            reference.reshape_and_cache(k[:cached], v[:cached], k_cache, v_cache, meta_prev.slot_mapping)
        new_k.append(k[cached:])
        new_v.append(v[cached:])
        rows.append((table, cached, q_len))
        k_rows.append(k)
        v_rows.append(v)
    meta, _ = make_meta(rows, block_size)
    reference.reshape_and_cache(torch.cat(new_k), torch.cat(new_v), k_cache, v_cache, meta.slot_mapping)
    t = meta.num_tokens
    q = torch.randn(t, hq, d, generator=gen, dtype=dtype)
    scale = d**-0.5
    out, lse = ops.paged_attention(q, k_cache, v_cache, meta, scale, return_lse=True)
    ref_out, ref_lse = _dense_oracle(q, k_rows, v_rows, [r[1] for r in rows_spec], scale)
    assert out.shape == (t, hq, d) and lse.shape == (t, hq) and lse.dtype == torch.float32
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref_out, atol=1e-10, rtol=1e-8)
    torch.testing.assert_close(lse, ref_lse.float(), atol=1e-5, rtol=1e-5)
    # The SDPA path (no lse) must agree with the explicit path; meta.cache is reused.
    out2 = ops.paged_attention(q, k_cache, v_cache, meta, scale)
    torch.testing.assert_close(out2, ref_out, atol=1e-10, rtol=1e-8)


@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2), (8, 1)])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("q_len", [1, 2, 5, 9])
def test_uniform_batches(hq, hkv, block_size, q_len):
    rows = [(c, q_len) for c in (0, 3, 17, 40) if c + q_len > 0]
    _run_case(q_len * 100 + block_size, hq, hkv, 16, block_size, rows)


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2), (16, 2)])
def test_mixed_batch_with_empty_rows(block_size, hq, hkv):
    # prefill, decode, chunked-prefill continuation and zero-length rows in one step
    rows = [(0, 9), (31, 1), (0, 0), (20, 4), (5, 0), (64, 1), (2, 7)]
    _run_case(7 + block_size, hq, hkv, 32, block_size, rows)


def test_pure_decode_fast_path_float32():
    rows = [(c, 1) for c in (1, 15, 16, 33, 100)]
    _run_case(3, 9, 3, 64, 16, rows, dtype=torch.float64)
    # float32 input: output stays float32 and is close to the float64 oracle
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn(8, 16, 2, 8, generator=gen)
    v_cache = torch.randn(8, 16, 2, 8, generator=gen)
    meta, _ = make_meta([([3, 1], 0, 20), ([5], 0, 3)], 16)
    meta_dec, _ = make_meta([([3, 1], 19, 1), ([5], 2, 1)], 16)
    q = torch.randn(2, 4, 8, generator=gen)
    out = ops.paged_attention(q, k_cache, v_cache, meta_dec, 0.3)
    assert out.dtype == torch.float32
    ref = ops.paged_attention(q.double(), k_cache.double(), v_cache.double(), meta_dec, 0.3)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    assert meta.num_rows == 2


def test_reshape_and_cache_skips_negative_slots():
    k_cache = torch.zeros(4, 2, 1, 3)
    v_cache = torch.zeros(4, 2, 1, 3)
    key = torch.arange(1, 4 * 3 + 1, dtype=torch.float32).view(4, 1, 3)
    value = -key
    slots = torch.tensor([5, -1, 0, 2], dtype=torch.int64)
    reference.reshape_and_cache(key, value, k_cache, v_cache, slots)
    flat_k, flat_v = k_cache.view(8, 1, 3), v_cache.view(8, 1, 3)
    torch.testing.assert_close(flat_k[5], key[0])
    torch.testing.assert_close(flat_k[0], key[2])
    torch.testing.assert_close(flat_v[2], value[3])
    written = {0, 2, 5}
    for s in range(8):
        if s not in written:
            assert flat_k[s].abs().sum() == 0 and flat_v[s].abs().sum() == 0


def test_validation_errors():
    k_cache = torch.zeros(4, 2, 1, 3)
    with pytest.raises(ValueError, match="int64"):
        ops.rope_and_cache(torch.zeros(2, 2, 3), torch.zeros(2, 1, 3), None, None, k_cache, k_cache.clone(),
                           torch.zeros(2, dtype=torch.int32))
    meta, _ = make_meta([([0], 0, 2)], 2)
    with pytest.raises(ValueError, match="multiple"):
        ops.paged_attention(torch.zeros(2, 3, 3), torch.zeros(4, 2, 2, 3), torch.zeros(4, 2, 2, 3), meta, 1.0)
    with pytest.raises(ValueError, match="block_size"):
        ops.paged_attention(torch.zeros(2, 2, 3), torch.zeros(4, 4, 1, 3), torch.zeros(4, 4, 1, 3), meta, 1.0)


@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 1)])
@pytest.mark.parametrize("rows", [[(0, 9)], [(0, 7)] * 3])
def test_fresh_equal_prompts_causal_path(hq, hkv, rows):
    _run_case(11, hq, hkv, 16, 16, rows)


@pytest.mark.parametrize("budget", [0, 1 << 30])
def test_decode_rows_mixed_with_verify_rows_both_layouts(budget, monkeypatch):
    # Decode rows with a few verify rows (1 + k queries): one decode batch with a row per query
    # (budget allows) or single-query and multi-query sub-batches (budget 0) give the same result.
    from pyengine.ops.reference import attention

    monkeypatch.setattr(attention, "_UNROLL_BUDGET", budget)
    rows = [(30, 1), (12, 5), (0, 1), (47, 1), (3, 3), (16, 1), (5, 0)]
    _run_case(11, 9, 3, 16, 4, rows)
    _run_case(12, 8, 2, 16, 16, rows)
