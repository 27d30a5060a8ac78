"""GPU attention kernels (hipkernels/attention/ via the ops facade and pyengine.ops.cuda) against the
PyTorch references.

Rules checked: the kernel equals the reference for decode, verify (q = 1 + k), prefill chunks and
mixed batches; causal within a row; GQA with any group size; MLA (576/512, one latent head); unused
cache pages (NaN) are never read; permuted block tables; zero-length rows; a row's result does not
depend on the rest of the batch (bit-identical); the MLA KV write skips slot -1. Kernel variants are
chosen with use_kernel_config, as the engine does.
"""
from __future__ import annotations

import random

import pytest
import torch

from pyengine import ops
from pyengine.engine.attention_metadata import AttentionMetadata
from pyengine.ops import reference
from pyengine.ops.kernel_config import use_kernel_config

try:
    from pyengine.ops import cuda as cuda_ops
except ImportError:  # no GPU kernels in this build
    cuda_ops = None

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or cuda_ops is None, reason="needs CUDA and the GPU kernels"),
]

DEV = "cuda"


def make_step(rows: list[tuple[int, int]], block_size: int, seed: int = 0, extra_blocks: int = 3):
    """rows: (context_len, q_len). Blocks come from a shuffled free list (permuted tables)."""
    rng = random.Random(seed)
    need = [(ctx + block_size - 1) // block_size for ctx, _ in rows]
    free = list(range(sum(need) + extra_blocks))
    rng.shuffle(free)
    tables, slots, qsl = [], [], [0]
    for (ctx, q_len), n in zip(rows, need):
        table = [free.pop() for _ in range(n)]
        tables.append(table)
        for pos in range(ctx - q_len, ctx):
            slots.append(table[pos // block_size] * block_size + pos % block_size if pos >= 0 else -1)
        qsl.append(qsl[-1] + q_len)
    width = max(need + [1])
    padded = [t + [-1] * (width - len(t)) for t in tables]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEV),
        block_tables=torch.tensor(padded, dtype=torch.int32, device=DEV).reshape(len(rows), width),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=DEV),
        context_lens=torch.tensor([c for c, _ in rows], dtype=torch.int32, device=DEV),
        max_query_len=max([q for _, q in rows] + [0]),
        max_context_len=max([c for c, _ in rows] + [0]),
        block_size=block_size,
    )
    return meta, tables, sum(need) + extra_blocks


def fill_cache(shape, tables, rows, block_size, dtype, gen):
    """NaN everywhere except the rows' context positions."""
    cache = torch.full(shape, float("nan"), dtype=dtype, device=DEV)
    flat = cache.view(shape[0] * shape[1], -1)
    for table, (ctx, _) in zip(tables, rows):
        if ctx == 0:
            continue
        pos = torch.arange(ctx)
        slots = torch.tensor(table, dtype=torch.int64)[pos // block_size] * block_size + pos % block_size
        flat[slots.to(DEV)] = torch.randn(ctx, flat.shape[1], generator=gen, device=DEV).to(dtype)
    return cache


def has_keys(rows) -> torch.Tensor:
    flags = []
    for ctx, q_len in rows:
        flags += [ctx - (q_len - 1 - i) > 0 for i in range(q_len)]
    return torch.tensor(flags, dtype=torch.bool, device=DEV)


def check_close(out, ref, lse, ref_lse, rows, dtype):
    assert not torch.isnan(out).any()
    tol = 2e-2 if dtype == torch.float16 else 5e-2
    keys = has_keys(rows)  # queries without keys: out 0 and lse +inf (checked below, not vs the reference)
    torch.testing.assert_close(out[keys].float(), ref[keys].float(), atol=tol, rtol=tol)
    torch.testing.assert_close(lse[keys], ref_lse[keys].float(), atol=1e-3, rtol=1e-3)
    assert torch.isinf(lse[~keys]).all() and (lse[~keys] > 0).all()
    assert (out[~keys] == 0).all()


def gqa_case(rows, block_size, hkv, group, dtype, head_dim=128, seed=0):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    meta, tables, nblocks = make_step(rows, block_size, seed)
    shape = (nblocks, block_size, hkv, head_dim)
    k = fill_cache(shape, tables, rows, block_size, dtype, gen)
    v = fill_cache(shape, tables, rows, block_size, dtype, gen)
    q = torch.randn(meta.num_tokens, hkv * group, head_dim, generator=gen, device=DEV).to(dtype)
    scale = head_dim ** -0.5
    out, lse = ops.paged_attention(q, k, v, meta, scale, return_lse=True)
    k0, v0 = torch.nan_to_num(k), torch.nan_to_num(v)  # the reference masks; keep it NaN-free anyway
    ref, ref_lse = reference.paged_attention(q, k0, v0, meta, scale, return_lse=True)
    return out, lse, ref, ref_lse


MIXED = [(37, 1), (1, 1), (100, 5), (9, 9), (0, 0), (513, 3), (64, 2), (700, 40), (2000, 7), (5, 4), (1500, 1)]


@pytest.fixture(params=["mma", "fma"])
def gqa_kernel(request):
    """Each GQA attention test runs with both kernels: "mma" (tensor cores, paged_attention_mma.hip:
    what NVIDIA runs) and "fma" (paged_attention.hip: what AMD runs), chosen on NVIDIA by
    KernelConfig.gqa_fma, a field of each launch's params."""
    with use_kernel_config(gqa_fma=request.param == "fma"):
        yield request.param


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 16, 64])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.usefixtures("gqa_kernel")
def test_gqa_mixed_batch_matches_reference(group, block_size, dtype):
    hkv = 2 if group == 8 else 4
    out, lse, ref, ref_lse = gqa_case(MIXED, block_size, hkv, group, dtype)
    check_close(out, ref, lse, ref_lse, MIXED, dtype)


@pytest.mark.parametrize("q_len", range(1, 10))
@pytest.mark.usefixtures("gqa_kernel")
def test_gqa_verify_lengths_llama_shape(q_len):
    rows = [(4096 + q_len, q_len), (77, q_len), (q_len, q_len)]
    out, lse, ref, ref_lse = gqa_case(rows, 16, 8, 4, torch.bfloat16, seed=q_len)
    check_close(out, ref, lse, ref_lse, rows, torch.bfloat16)


@pytest.mark.parametrize("head_dim", [64, 256])
@pytest.mark.usefixtures("gqa_kernel")
def test_gqa_other_head_dims(head_dim):
    rows = [(300, 1), (1200, 4), (50, 20)]
    out, lse, ref, ref_lse = gqa_case(rows, 16, 2, 3, torch.float16, head_dim=head_dim)
    check_close(out, ref, lse, ref_lse, rows, torch.float16)


@pytest.mark.usefixtures("gqa_kernel")
def test_gqa_long_context_32k():
    rows = [(32768, 1), (32768 - 3, 5), (20000, 2)]
    out, lse, ref, ref_lse = gqa_case(rows, 64, 8, 4, torch.bfloat16)
    check_close(out, ref, lse, ref_lse, rows, torch.bfloat16)


@pytest.mark.usefixtures("gqa_kernel")
def test_context_shorter_than_query_gives_zero_and_inf():
    rows = [(2, 4), (0, 3), (10, 1)]  # queries 0, 1 of row 0 and all of row 1 see no keys
    out, lse, ref, ref_lse = gqa_case(rows, 16, 2, 2, torch.float16)
    check_close(out, ref, lse, ref_lse, rows, torch.float16)


@pytest.mark.parametrize("head_dim, group", [(128, 4), (128, 8), (64, 8)])
def test_gqa_pairs_per_block_change_no_bit(head_dim, group):
    """Query-head pairs per block are a launch choice of the FMA kernel (fewer when the grid is small,
    as in batch-1 decode): every pair's arithmetic is the same, so forcing 1, 2, 4 or 8 gives the same
    bits on a mixed batch (decode, verify, prefill chunks, splits), and so does the automatic choice."""
    hkv = 32 // group
    results = []
    for pairs in (1, 2, 4, 8, 0):
        with use_kernel_config(gqa_fma=True, gqa_pairs_per_block=pairs):
            out, lse, ref, ref_lse = gqa_case(MIXED, 16, hkv, group, torch.bfloat16, head_dim, seed=4)
        check_close(out, ref, lse, ref_lse, MIXED, torch.bfloat16)
        results.append((out, lse))
    for out, lse in results[1:]:
        assert torch.equal(out, results[0][0]) and torch.equal(lse, results[0][1])


@pytest.mark.usefixtures("gqa_kernel")
@pytest.mark.parametrize("ctx", [300, 5000])
def test_gqa_verify_tokens_equal_decode_bits(ctx):
    """Speculative decoding is lossless only if a verify step scores each of its tokens exactly as
    plain decoding would: token i of a verify row (q_len 6) must equal, bit for bit, the same query
    decoded alone against its own context (ctx - 5 + i keys, the same block table)."""

    q_len, hkv, group, d, bs = 6, 8, 4, 128, 16
    meta, tables, nblocks = make_step([(ctx, q_len)], bs, seed=ctx)
    gen = torch.Generator(device=DEV).manual_seed(ctx)
    k = fill_cache((nblocks, bs, hkv, d), tables, [(ctx, q_len)], bs, torch.bfloat16, gen)
    v = fill_cache((nblocks, bs, hkv, d), tables, [(ctx, q_len)], bs, torch.bfloat16, gen)
    q = torch.randn(q_len, hkv * group, d, generator=gen, device=DEV).to(torch.bfloat16)
    out, lse = ops.paged_attention(q, k, v, meta, d ** -0.5, return_lse=True)
    assert not torch.isnan(out).any()
    for i in range(q_len):
        lim = ctx - (q_len - 1 - i)
        alone = AttentionMetadata(
            slot_mapping=torch.tensor([-1], device=DEV), block_tables=meta.block_tables,
            query_start_loc=torch.tensor([0, 1], dtype=torch.int32, device=DEV),
            context_lens=torch.tensor([lim], dtype=torch.int32, device=DEV),
            max_query_len=1, max_context_len=lim, block_size=bs)
        o1, l1 = ops.paged_attention(q[i:i + 1].contiguous(), k, v, alone, d ** -0.5, return_lse=True)
        assert torch.equal(o1[0], out[i]) and torch.equal(l1[0], lse[i]), f"token {i}"


def test_gqa_fma_switch_is_another_kernel():
    """KernelConfig.gqa_fma really switches kernels: both match the reference (tests above), but
    tensor cores and FMA sum in other orders, so the fp32 lse cannot agree bit for bit."""
    rows = [(700, 3), (2100, 1)]
    with use_kernel_config(gqa_fma=False):
        _, lse_mma, _, _ = gqa_case(rows, 16, 8, 4, torch.bfloat16)
    with use_kernel_config(gqa_fma=True):
        _, lse_fma, _, _ = gqa_case(rows, 16, 8, 4, torch.bfloat16)
    torch.testing.assert_close(lse_mma, lse_fma, atol=1e-3, rtol=1e-3)
    assert not torch.equal(lse_mma, lse_fma)


@pytest.mark.usefixtures("gqa_kernel")
def test_gqa_decode_row_alone_and_in_a_large_batch():
    """Alone, a decode row's grid is tiny and the launcher picks one pair per block; in a batch of 48
    rows it keeps the model's 4. The row's output and lse are bit-identical either way."""
    row = (300, 1)
    crowd = [(1000 + 37 * i, 1) for i in range(47)]
    crowd.insert(20, row)
    alone = gqa_row_outputs([row], 0, seed=21)
    together = gqa_row_outputs(crowd, 20, seed=21)
    assert not torch.isnan(alone[0]).any()
    assert torch.equal(alone[0], together[0]) and torch.equal(alone[1], together[1])


@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.usefixtures("gqa_kernel")
def test_gqa_reads_the_keys_rope_and_cache_just_wrote(pdl):
    """A decode step writes this token's K/V with rope_and_cache, which lets the next kernel start
    early; the attention kernel, launched with programmatic dependent launch (pdl), must still read
    the new keys. The written slots start as NaN, so a stale read shows. Captured in a CUDA graph,
    rope -> attention equals the same two ops with a device synchronisation in between."""
    rows = [(37, 1), (300, 1), (1025, 1)]  # the last one splits (workspace + combine)
    hq, hkv, d, bs = 32, 8, 128, 16
    meta, tables, nblocks = make_step(rows, bs, seed=9)
    gen = torch.Generator(device=DEV).manual_seed(9)
    k = fill_cache((nblocks, bs, hkv, d), tables, rows, bs, torch.bfloat16, gen)
    v = fill_cache((nblocks, bs, hkv, d), tables, rows, bs, torch.bfloat16, gen)
    k.view(-1, hkv, d)[meta.slot_mapping] = float("nan")
    v.view(-1, hkv, d)[meta.slot_mapping] = float("nan")
    t = meta.num_tokens
    qk = torch.randn(t, hq + hkv, d, generator=gen, device=DEV).to(torch.bfloat16)
    v_new = torch.randn(t, hkv, d, generator=gen, device=DEV).to(torch.bfloat16)
    angle = torch.rand(t, d // 2, generator=gen, device=DEV) * 6.28
    cos = torch.cat([angle.cos(), angle.cos()], -1).to(torch.bfloat16)
    sin = torch.cat([-angle.sin(), angle.sin()], -1).to(torch.bfloat16)

    def step(k_cache, v_cache, qk_in, sync):
        ops.rope_and_cache(qk_in, v_new, cos, sin, k_cache, v_cache, meta.slot_mapping)
        if sync:
            torch.cuda.synchronize()
        return ops.paged_attention(qk_in[:, :hq], k_cache, v_cache, meta, d ** -0.5)

    with use_kernel_config(pdl=pdl):
        expected = step(k.clone(), v.clone(), qk.clone(), sync=True)
        assert not torch.isnan(expected).any()
        k_g, v_g, qk_g = k.clone(), v.clone(), qk.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step(k_g, v_g, qk_g, sync=False)
    graph.replay()  # capturing ran nothing: this is the step's only run on these copies
    torch.cuda.synchronize()
    assert torch.equal(out, expected)


@pytest.fixture(params=["fast", "small"])
def mla_tile(request):
    """Each MLA attention test runs with both tile configurations of hipkernels/attention/mla_tile.h:
    "fast" (wgmma, ~226 KB of shared memory) and "small" (FMA products in 57.5 KB: what AMD gfx90a
    runs), chosen on NVIDIA by KernelConfig.mla_small_tile, a field of each launch's params."""
    with use_kernel_config(mla_small_tile=request.param == "small"):
        yield request.param


def mla_case(rows, block_size, heads, dtype, seed=0):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    meta, tables, nblocks = make_step(rows, block_size, seed)
    kv = fill_cache((nblocks, block_size, 576), tables, rows, block_size, dtype, gen)
    q = torch.randn(meta.num_tokens, heads, 576, generator=gen, device=DEV).to(dtype)
    scale = 192 ** -0.5
    out, lse = ops.paged_attention_mla(q, kv, meta, scale, return_lse=True)
    ref, ref_lse = reference.paged_attention_mla(q, torch.nan_to_num(kv), meta, scale, return_lse=True)
    return out, lse, ref, ref_lse


@pytest.mark.usefixtures("mla_tile")
@pytest.mark.parametrize("block_size", [1, 16, 64])
@pytest.mark.parametrize("heads", [16, 128])
def test_mla_matches_reference(heads, block_size):
    rows = [(40, 1), (700, 3), (0, 0), (9, 9), (2100, 6), (300, 30)]
    out, lse, ref, ref_lse = mla_case(rows, block_size, heads, torch.bfloat16)
    check_close(out, ref, lse, ref_lse, rows, torch.bfloat16)


@pytest.mark.usefixtures("mla_tile")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads", [20, 64])
def test_mla_head_tiles_across_tokens_and_splits(heads, dtype):
    """The MLA kernel tiles (token, head) pairs 64 (fast) or 16 (small) at a time: with 20 heads a
    tile spans query tokens (each with its own causal limit) and ends mid-token; rows of several key
    splits (> 512 keys) with q_len up to 16 go through the split workspace, longer ones (17) write
    directly."""
    rows = [(1500, 2), (3000, 1), (0, 0), (5, 7), (600, 16), (70, 17), (1025, 9)]
    out, lse, ref, ref_lse = mla_case(rows, 16, heads, dtype, seed=heads)
    check_close(out, ref, lse, ref_lse, rows, dtype)


@pytest.mark.usefixtures("mla_tile")
@pytest.mark.parametrize("q_len", range(1, 10))
def test_mla_verify_lengths(q_len):
    rows = [(1000 + q_len, q_len), (q_len, q_len)]
    out, lse, ref, ref_lse = mla_case(rows, 64, 16, torch.float16, seed=q_len)
    check_close(out, ref, lse, ref_lse, rows, torch.float16)


@pytest.mark.usefixtures("mla_tile")
def test_mla_long_context_32k():
    rows = [(32768, 1), (32000, 4)]
    out, lse, ref, ref_lse = mla_case(rows, 64, 16, torch.bfloat16)
    check_close(out, ref, lse, ref_lse, rows, torch.bfloat16)


def _row_alone_vs_in_batch(run):
    """run(rows, which) -> outputs of row `which`; the row must be bit-identical in any batch."""
    row = (3000, 3)
    alone = run([row], 0)
    crowd = [(10, 1), (700, 40), row, (5000, 1), (64, 9)]
    together = run(crowd, 2)
    assert torch.equal(alone[0], together[0]) and torch.equal(alone[1], together[1])


def gqa_row_outputs(rows, which, seed=7):
    """Output and lse of row `which` (Llama-3-8B heads, block size 16) in a batch of `rows`: the row's
    keys, values and queries depend only on seed, every other row gets random ones."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    meta, tables, nblocks = make_step(rows, 16, seed=len(rows))
    shape = (nblocks, 16, 8, 128)
    k = torch.full(shape, float("nan"), dtype=torch.bfloat16, device=DEV)
    v = torch.full_like(k, float("nan"))
    ctx, q_len = rows[which]
    data_k = torch.randn(ctx, 8, 128, generator=gen, device=DEV).to(k.dtype)
    data_v = torch.randn(ctx, 8, 128, generator=gen, device=DEV).to(k.dtype)
    q_row = torch.randn(q_len, 32, 128, generator=gen, device=DEV).to(k.dtype)
    for r, (c, _) in enumerate(rows):  # every row gets some keys; row `which` gets data_k/v
        pos = torch.arange(c)
        slots = (torch.tensor(tables[r])[pos // 16] * 16 + pos % 16).to(DEV)
        src_k = data_k if r == which else torch.randn(c, 8, 128, device=DEV).to(k.dtype)
        src_v = data_v if r == which else torch.randn(c, 8, 128, device=DEV).to(k.dtype)
        k.view(-1, 8, 128)[slots] = src_k
        v.view(-1, 8, 128)[slots] = src_v
    q = torch.randn(meta.num_tokens, 32, 128, device=DEV).to(k.dtype)
    q0 = int(meta.query_start_loc[which])
    q[q0:q0 + q_len] = q_row
    out, lse = ops.paged_attention(q, k, v, meta, 128 ** -0.5, return_lse=True)
    return out[q0:q0 + q_len], lse[q0:q0 + q_len]


@pytest.mark.usefixtures("gqa_kernel")
def test_gqa_batch_invariant():
    _row_alone_vs_in_batch(gqa_row_outputs)


@pytest.mark.usefixtures("mla_tile")
def test_mla_batch_invariant():
    def run(rows, which):
        gen = torch.Generator(device=DEV).manual_seed(3)
        meta, tables, nblocks = make_step(rows, 64, seed=len(rows))
        kv = torch.full((nblocks, 64, 576), float("nan"), dtype=torch.bfloat16, device=DEV)
        ctx, q_len = rows[which]
        data = torch.randn(ctx, 576, generator=gen, device=DEV).to(kv.dtype)
        q_row = torch.randn(q_len, 128, 576, generator=gen, device=DEV).to(kv.dtype)
        for r, (c, _) in enumerate(rows):
            pos = torch.arange(c)
            slots = (torch.tensor(tables[r])[pos // 64] * 64 + pos % 64).to(DEV)
            kv.view(-1, 576)[slots] = data if r == which else torch.randn(c, 576, device=DEV).to(kv.dtype)
        q = torch.randn(meta.num_tokens, 128, 576, device=DEV).to(kv.dtype)
        q0 = int(meta.query_start_loc[which])
        q[q0:q0 + q_len] = q_row
        out, lse = ops.paged_attention_mla(q, kv, meta, 192 ** -0.5, return_lse=True)
        return out[q0:q0 + q_len], lse[q0:q0 + q_len]

    _row_alone_vs_in_batch(run)


@pytest.mark.usefixtures("mla_tile")
def test_mla_repeated_launches_give_the_same_bits():
    """The fast tile hands tiles between its warpgroups through named barriers; a hand-over race would
    show as launches of the same step that disagree. 40 launches of a mixed batch, 1 to 24 key tiles
    per block, must all give the first one's bits."""
    rows = [(700, 3), (2100, 1), (64, 1), (130, 2), (3800, 4), (0, 0), (9, 9)] * 6 + [(20000, 1)]
    gen = torch.Generator(device=DEV).manual_seed(5)
    meta, tables, nblocks = make_step(rows, 64, seed=5)
    kv = fill_cache((nblocks, 64, 576), tables, rows, 64, torch.bfloat16, gen)
    q = torch.randn(meta.num_tokens, 128, 576, generator=gen, device=DEV).to(torch.bfloat16)
    first, first_lse = ops.paged_attention_mla(q, kv, meta, 192 ** -0.5, return_lse=True)
    for _ in range(40):
        out, lse = ops.paged_attention_mla(q, kv, meta, 192 ** -0.5, return_lse=True)
        assert torch.equal(out, first) and torch.equal(lse, first_lse)


def test_mla_small_tile_is_another_path():
    """KernelConfig.mla_small_tile really switches kernels: both match the reference (tests above),
    but the FMA products sum in another order than wgmma, so the fp32 lse cannot agree bit for bit."""
    rows = [(700, 3), (2100, 1)]
    with use_kernel_config(mla_small_tile=False):
        _, lse_fast, _, _ = mla_case(rows, 16, 128, torch.bfloat16)
    with use_kernel_config(mla_small_tile=True):
        _, lse_small, _, _ = mla_case(rows, 16, 128, torch.bfloat16)
    torch.testing.assert_close(lse_small, lse_fast, atol=1e-3, rtol=1e-3)
    assert not torch.equal(lse_small, lse_fast)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_reshape_and_cache_mla_skips_minus_one(dtype):
    T, nb, bs = 29, 8, 64
    latent = torch.randn(T, 576 + 128, device=DEV).to(dtype)
    c_kv, k_pe = latent[:, :512], latent[:, 600:664]  # strided views, as a fused projection gives
    slots = torch.randperm(nb * bs, device=DEV)[:T]
    slots[1::4] = -1
    kv = torch.full((nb, bs, 576), float("nan"), dtype=dtype, device=DEV)
    kv_ref = kv.clone()
    ops.reshape_and_cache_mla(c_kv, k_pe, kv, slots)
    reference.reshape_and_cache_mla(c_kv, k_pe, kv_ref, slots)
    assert torch.equal(kv.nan_to_num(7.0), kv_ref.nan_to_num(7.0))


def test_validation_errors_are_value_errors():
    q = torch.randn(3, 8, 128, device=DEV).half()
    k = torch.zeros(4, 16, 3, 128, device=DEV).half()
    meta, _, _ = make_step([(5, 3)], 16)
    with pytest.raises(ValueError, match="multiple"):
        ops.paged_attention(q, k, k, meta, 0.1)
