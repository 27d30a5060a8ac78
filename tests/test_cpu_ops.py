"""The C++ CPU layer ops (pyengine.ops.cpu) against the PyTorch references, fp32 and bf16.

Attention and the packed GEMM are also checked for the property greedy speculative decoding needs
(issue 18, "a row's numbers never depend on the batch"): a query's output is bit-identical whether
its row is alone or in a batch (next to a long prefill too), whether it is the last query of a
verify row, the only query of a decode row over the same keys, or one query inside a long prefill;
a GEMM row's output is the same bits for every M and every pool thread count."""
from __future__ import annotations

import random

import pytest
import torch

from pyengine import ops
from pyengine.ops import cpu as cpu_ops
from pyengine.ops import reference
from pyengine.ops.kernel_config import use_kernel_config
from tests.utils_paged import make_meta

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(params=["best", "avx2"])
def kernel_family(request):
    """Attention and packed-GEMM tests run on the kernels this CPU picks and on the AVX2 + FMA ones
    (which CPUs without AVX-512 run; forced here by KernelConfig.cpu_avx2_kernels)."""
    if request.param == "avx2" and not AVX2_FMA_CPU:
        pytest.skip("the AVX2 kernels need AVX2 and FMA")
    with use_kernel_config(cpu_avx2_kernels=request.param == "avx2"):
        yield request.param


def _tol(dtype: torch.dtype) -> dict[str, float]:
    # fp32: only the summation order differs. bf16: both sides round the same fp32 value once, so
    # they differ by at most one bf16 step (2^-8 relative) where the fp32 values straddle a tie.
    return {"atol": 2e-5, "rtol": 2e-5} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 8e-3}


def _paged_case(seed: int, hq: int, hkv: int, d: int, block_size: int, rows_spec: list[tuple[int, int]],
                dtype: torch.dtype):
    """Caches (unused pages NaN, permuted tables) holding random K/V for rows of (cached, q_len)."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    blocks = sum(-(-(c + q) // block_size) for c, q in rows_spec) + 3
    free = list(range(blocks))
    rng.shuffle(free)
    k_cache = torch.full((blocks, block_size, hkv, d), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    rows = []
    for cached, q_len in rows_spec:
        table = [free.pop() for _ in range(-(-(cached + q_len) // block_size))]
        rows.append((table, cached, q_len))
        full, _ = make_meta([(table, 0, cached + q_len)], block_size)
        kv = torch.randn(2, cached + q_len, hkv, d, generator=gen).to(dtype)
        reference.reshape_and_cache(kv[0], kv[1], k_cache, v_cache, full.slot_mapping)
    meta, _ = make_meta(rows, block_size)
    q = torch.randn(meta.num_tokens, hq, d, generator=gen).to(dtype)
    return q, k_cache, v_cache, meta, rows


ATTENTION_CASES = [
    # (hq, hkv, d, block_size, rows: (cached, q_len))
    (4, 4, 64, 16, [(0, 1), (17, 1), (40, 1)]),  # decode, MHA
    (9, 3, 64, 16, [(10, 1), (30, 5), (0, 1), (47, 3)]),  # decode + verify rows, GQA 3
    (8, 2, 128, 1, [(5, 1), (3, 4), (20, 1)]),  # block size 1, head dim 128
    (4, 1, 32, 4, [(0, 7), (9, 1), (6, 0), (33, 2)]),  # prefill row, zero-length row, MQA
    (6, 2, 64, 2, [(60, 9), (3, 1)]),  # k + 1 = 9 queries across many small blocks
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", range(len(ATTENTION_CASES)))
def test_paged_attention_matches_reference(case: int, dtype: torch.dtype, kernel_family) -> None:
    hq, hkv, d, block_size, rows_spec = ATTENTION_CASES[case]
    q, k_cache, v_cache, meta, _ = _paged_case(case, hq, hkv, d, block_size, rows_spec, dtype)
    out, lse = cpu_ops.paged_attention(q, k_cache, v_cache, meta, d**-0.5, return_lse=True)
    ref, ref_lse = reference.paged_attention(q, k_cache, v_cache, meta, d**-0.5, return_lse=True)
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), ref.float(), **_tol(dtype))
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_attention_is_batch_invariant(dtype: torch.dtype, kernel_family) -> None:
    """Each query alone (a decode row over exactly the keys it sees) == the same query inside a
    batch of verify and decode rows, bit for bit."""
    hq, hkv, d, bs = 9, 3, 64, 16
    rows_spec = [(21, 5), (40, 1), (3, 3), (70, 1)]
    q, k_cache, v_cache, meta, rows = _paged_case(7, hq, hkv, d, bs, rows_spec, dtype)
    batched = cpu_ops.paged_attention(q, k_cache, v_cache, meta, 0.125)
    t = 0
    for table, cached, q_len in rows:
        for i in range(q_len):
            alone_meta, _ = make_meta([(table, cached + i, 1)], bs)
            alone = cpu_ops.paged_attention(q[t:t + 1], k_cache, v_cache, alone_meta, 0.125)
            assert torch.equal(alone, batched[t:t + 1]), f"token {t} differs alone vs batched"
            t += 1


def test_the_avx2_kernel_is_another_arithmetic() -> None:
    """cpu_avx2_kernels reaches the intrinsics kernel: fp32 outputs of the two kernels differ in
    the last bits somewhere (each matches the reference, above), on an AVX-512 CPU."""
    if not AVX2_FMA_CPU:
        pytest.skip("the AVX2 attention kernel needs AVX2 and FMA")
    q, k_cache, v_cache, meta, _ = _paged_case(1, 9, 3, 64, 16, [(10, 1), (30, 5), (0, 1), (47, 3)], torch.float32)
    with use_kernel_config(cpu_avx2_kernels=True):
        avx2 = cpu_ops.paged_attention(q, k_cache, v_cache, meta, 0.125)
    best = cpu_ops.paged_attention(q, k_cache, v_cache, meta, 0.125)
    if "avx512f" not in _cpu_flags():
        assert torch.equal(avx2, best)  # this CPU runs the AVX2 kernel anyway
    else:
        assert not torch.equal(avx2, best)
    torch.testing.assert_close(avx2, best, atol=2e-6, rtol=2e-6)


@pytest.fixture
def pool_of_two(restore_pool) -> None:
    """As inside an engine step: torch at one thread, so the C++ ops split work over a pool of 2."""
    torch.set_num_threads(1)
    cpu_ops.kernels.set_num_threads(2)


def _no_reference(*args, **kwargs):
    raise AssertionError("the step ran the PyTorch reference instead of the C++ kernel")


# Decode rows around a 200-token prefill: 200 x 200 = 40000 query-key pairs in that row alone, more
# than the 32768 above which the step used to switch to the SDPA reference.
LONG_ROWS = [(40, 1), (0, 200), (70, 1), (35, 3)]


@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (4, 2, 80)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_long_prefill_runs_the_kernel_and_every_query_keeps_its_bits(hq: int, hkv: int, d: int, dtype: torch.dtype,
                                                                    pool_of_two, monkeypatch, kernel_family) -> None:
    """A step with a long prefill row runs the C++ kernel (never the reference), split over the
    pool inside the row, and each query's output (and lse) is bit-identical to the same query as a
    1-query row over the same context, whether it belongs to a decode row, a verify row or the long
    prefill; the step's result does not depend on the pool's thread count. Head dim 80 covers a
    head that is not a multiple of 32."""
    q, k_cache, v_cache, meta, rows = _paged_case(11, hq, hkv, d, 16, LONG_ROWS, dtype)
    assert cpu_ops.step_tables(meta)[3] > 1 << 15
    ref, ref_lse = reference.paged_attention(q, k_cache, v_cache, meta, d**-0.5, return_lse=True)
    monkeypatch.setattr(reference, "paged_attention", _no_reference)
    out, lse = cpu_ops.paged_attention(q, k_cache, v_cache, meta, d**-0.5, return_lse=True)
    torch.testing.assert_close(out.float(), ref.float(), **_tol(dtype))
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-5)
    starts = [0]
    for _, _, q_len in rows:
        starts.append(starts[-1] + q_len)
    for (table, cached, q_len), t0 in zip(rows, starts):
        picks = range(q_len) if q_len < 10 else (0, 1, 15, 16, 31, 32, 33, 63, 64, 100, 198, 199)
        for i in picks:
            alone_meta, _ = make_meta([(table, cached + i, 1)], 16)
            alone, alone_lse = cpu_ops.paged_attention(q[t0 + i:t0 + i + 1], k_cache, v_cache, alone_meta, d**-0.5,
                                                       return_lse=True)
            assert torch.equal(alone, out[t0 + i:t0 + i + 1]), f"token {t0 + i} differs alone vs in the step"
            assert torch.equal(alone_lse, lse[t0 + i:t0 + i + 1])
    # The prefill row on its own (one row, no decode rows beside it), and the step on one thread.
    solo_meta, _ = make_meta([rows[1]], 16)
    solo = cpu_ops.paged_attention(q[starts[1]:starts[2]], k_cache, v_cache, solo_meta, d**-0.5)
    assert torch.equal(solo, out[starts[1]:starts[2]])
    cpu_ops.kernels.set_num_threads(1)
    assert torch.equal(cpu_ops.paged_attention(q, k_cache, v_cache, meta, d**-0.5), out)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_row_alone_equals_next_to_a_long_prefill(dtype: torch.dtype, pool_of_two) -> None:
    """The issue's case through the ops facade: decode rows alone, and in one step with a prefill
    row of 300 x 300 query-key pairs, give the same bits (before, the whole step switched to SDPA,
    whose results differ from the kernel's in the last bits)."""
    q, k_cache, v_cache, meta, rows = _paged_case(12, 9, 3, 64, 16, [(300, 0), (57, 1), (120, 1), (9, 1), (0, 300)],
                                                  dtype)
    both = ops.paged_attention(q, k_cache, v_cache, meta, 0.125)
    for t, row in enumerate(rows[1:4]):
        alone_meta, _ = make_meta([row], 16)
        assert torch.equal(ops.paged_attention(q[t:t + 1], k_cache, v_cache, alone_meta, 0.125), both[t:t + 1])


def test_paged_attention_rejects_block_ids_outside_the_cache() -> None:
    q, k_cache, v_cache, meta, _ = _paged_case(0, 4, 4, 64, 16, [(20, 1)], torch.float32)
    meta.block_tables[0, 1] = k_cache.shape[0]  # one past the last block
    with pytest.raises(ValueError, match="outside the cache"):
        cpu_ops.paged_attention(q, k_cache, v_cache, meta, 0.125)


def test_ops_dispatch_to_cpu_kernels_and_fall_back() -> None:
    """ops.paged_attention runs the C++ path on fp32 (its output differs from the reference in the
    last bits), and the reference for float64 and head dims that are not multiples of 16."""
    q, k_cache, v_cache, meta, _ = _paged_case(3, 4, 2, 64, 16, [(30, 1), (50, 1)], torch.float32)
    assert torch.equal(ops.paged_attention(q, k_cache, v_cache, meta, 0.125),
                       cpu_ops.paged_attention(q, k_cache, v_cache, meta, 0.125))
    q, k_cache, v_cache, meta, _ = _paged_case(3, 4, 2, 40, 16, [(30, 1)], torch.float32)
    assert torch.equal(cpu_ops.paged_attention(q, k_cache, v_cache, meta, 0.125),
                       reference.paged_attention(q, k_cache, v_cache, meta, 0.125))


def test_cpu_kernels_follow_the_kernel_config() -> None:
    """KernelConfig.cpu_kernels is read at each call: off, the same process runs the reference."""
    q, k_cache, v_cache, meta, _ = _paged_case(3, 4, 2, 64, 16, [(30, 1), (50, 1)], torch.float32)
    cpu_out = cpu_ops.paged_attention(q, k_cache, v_cache, meta, 0.125)
    ref_out = reference.paged_attention(q, k_cache, v_cache, meta, 0.125)
    assert not torch.equal(cpu_out, ref_out)  # the two paths differ in the last bits
    with use_kernel_config(cpu_kernels=False):
        assert not ops.cpu_kernels_enabled()
        assert torch.equal(ops.paged_attention(q, k_cache, v_cache, meta, 0.125), ref_out)
    assert torch.equal(ops.paged_attention(q, k_cache, v_cache, meta, 0.125), cpu_out)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_rope", [True, False])
def test_rope_and_cache_matches_reference(dtype: torch.dtype, with_rope: bool) -> None:
    gen = torch.Generator().manual_seed(1)
    t, hq, hkv, d, bs, blocks = 7, 6, 2, 64, 4, 6
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=gen).to(dtype)  # strided q|k and v views
    cos = torch.randn(t, d, generator=gen).to(dtype) if with_rope else None
    sin = torch.randn(t, d, generator=gen).to(dtype) if with_rope else None
    slots = torch.tensor([3, -1, 0, 17, 9, -1, 22])
    results = []
    for impl in (cpu_ops.rope_and_cache, reference.rope_and_cache):
        x = qkv.clone()
        qk = x[:, : (hq + hkv) * d].view(t, hq + hkv, d)
        v = x[:, (hq + hkv) * d:].view(t, hkv, d)
        caches = [torch.full((blocks, bs, hkv, d), float("nan"), dtype=dtype) for _ in range(2)]
        impl(qk, v, cos, sin, caches[0], caches[1], slots)
        results.append((x, caches))
    (x, caches), (x_ref, caches_ref) = results
    torch.testing.assert_close(x.float(), x_ref.float(), **_tol(dtype))
    for c, c_ref in zip(caches, caches_ref):
        assert torch.equal(c.isnan(), c_ref.isnan())  # same slots written, slot -1 skipped
        torch.testing.assert_close(c.nan_to_num().float(), c_ref.nan_to_num().float(), **_tol(dtype))
    assert caches[0].view(-1, hkv, d)[[1, 2, 4]].isnan().all()  # untouched slots


@pytest.mark.parametrize("dtype", DTYPES)
def test_norms_and_activation_match_reference(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(5, 200, generator=gen).to(dtype) * 3
    res = torch.randn(5, 200, generator=gen).to(dtype)
    w = torch.randn(200, generator=gen).to(dtype)
    torch.testing.assert_close(cpu_ops.rms_norm(x, w, 1e-5).float(),
                               reference.rms_norm(x, w, 1e-5).float(), **_tol(dtype))
    a, ra = cpu_ops.fused_add_rms_norm(x.clone(), res.clone(), w, 1e-5)
    b, rb = reference.fused_add_rms_norm(x.clone(), res.clone(), w, 1e-5)
    assert torch.equal(ra, rb)  # the residual sum is rounded once on both sides
    torch.testing.assert_close(a.float(), b.float(), **_tol(dtype))
    g = torch.randn(4, 2 * 333, generator=gen).to(dtype) * 6
    torch.testing.assert_close(cpu_ops.silu_and_mul(g).float(), reference.silu_and_mul(g).float(),
                               **_tol(dtype))


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


# The packed GEMM must run on every AVX-512 or AVX2 + FMA (x86-64-v3) CPU, CI's included: the skip
# follows the CPU's flags, not has_gemm(), so a GEMM that wrongly reports itself missing fails here.
GEMM_CPU = {"avx2", "fma"} <= _cpu_flags() or {"avx512f", "avx512bw", "avx512vl"} <= _cpu_flags()
AVX2_FMA_CPU = {"avx2", "fma"} <= _cpu_flags()  # the CPU attention's AVX2 kernel runs here
needs_gemm = pytest.mark.skipif(not GEMM_CPU, reason="CPU has neither AVX-512 nor AVX2 + FMA")


@pytest.mark.skipif(not _cpu_flags(), reason="needs the CPU flags of /proc/cpuinfo")
def test_has_gemm_reports_the_kernels_this_cpu_runs() -> None:
    """has_gemm / gemm_isa per dtype follow the CPU's flags: AVX-512 kernels where it has
    avx512f/bw/vl (+ avx512_bf16 for bf16), else the AVX2 + FMA ones, else none; PackedLinear
    agrees and reports which kernels a weight runs."""
    flags = _cpu_flags()
    avx512 = {"avx512f", "avx512bw", "avx512vl"} <= flags
    avx2 = {"avx2", "fma"} <= flags
    for code, dtype, extra in ((0, torch.float32, set()), (1, torch.bfloat16, {"avx512_bf16"})):
        want = 3 if avx512 and extra <= flags else 2 if avx2 else 0
        assert cpu_ops.kernels.gemm_isa(code) == want, (dtype, sorted(flags & {"avx2", "fma", "avx512f", "avx512_bf16"}))
        assert cpu_ops.kernels.has_gemm(code) == (want != 0)
        assert cpu_ops.PackedLinear.supported(torch.zeros(2, 16, dtype=dtype)) == (want != 0)
        if want:
            assert cpu_ops.PackedLinear(torch.zeros(2, 16, dtype=dtype)).isa == {2: "avx2", 3: "avx512"}[want]


GEMM_SHAPES = [(64, 30), (96, 70), (576, 200), (1536, 40)]  # K 1536: several L2 row chunks at M 300


@needs_gemm
@pytest.mark.parametrize("k,n", GEMM_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_linear_row_bits_do_not_depend_on_m_or_threads(k: int, n: int, dtype: torch.dtype,
                                                             restore_pool, kernel_family) -> None:
    """y = x @ W + b for M = 1, 2, 5, 17, 64, 300 rows: every row equals the same row computed
    alone, or in any other slice of the batch (other row groups, other row chunks), bit for bit,
    with 1, 2 or 3 pool threads; and the values are those of the exact product within fp32
    noise (fp32) or one bf16 rounding (bf16). N is not a multiple of the 16-column panels."""
    gen = torch.Generator().manual_seed(k + n)
    w = torch.randn(k, n, generator=gen).to(dtype)
    x = torch.randn(300, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    layer = cpu_ops.PackedLinear(w, compact=False)
    assert kernel_family == "best" or layer.isa == "avx2"
    cpu_ops.kernels.set_num_threads(1)
    full = layer(x, bias)
    for m in (1, 2, 5, 17, 64, 300):
        assert torch.equal(layer(x[:m], bias), full[:m]), f"M = {m}"
    for r in (0, 1, 3, 5, 6, 7, 29, 30, 31, 64, 150, 299):
        assert torch.equal(layer(x[r:r + 1], bias), full[r:r + 1]), f"row {r} alone"
    assert torch.equal(layer(x[3:70], bias), full[3:70])  # rows shifted against the row groups
    wide = torch.cat([x, x], dim=1)  # a strided x: rows 2K apart
    assert torch.equal(layer(wide[:, :k], bias), full)
    for threads in (2, 3):
        cpu_ops.kernels.set_num_threads(threads)
        assert torch.equal(layer(x, bias), full), f"{threads} threads"
        assert torch.equal(layer(x[150:151], bias), full[150:151])
    exact = x.double() @ w.double() + bias.double()
    tol = {"atol": 1e-4, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 8e-3}
    torch.testing.assert_close(full.double(), exact, **tol)
    torch.testing.assert_close(full.float(), (x.float() @ w.float() + bias.float()).to(dtype).float(), **tol)


@needs_gemm
@pytest.mark.parametrize("m", [1, 3, 16, 17, 40])
@pytest.mark.parametrize("n", [70, 30])
@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_linear_matches_exact_matmul(m: int, n: int, dtype: torch.dtype, kernel_family) -> None:
    """fp32 accumulation and one rounding to the dtype: within fp32 noise (fp32) or one bf16 step
    (bf16) of the exact product of the same inputs. n is not a multiple of the 16-column panels;
    70 (5 panels) gives tiles of 2 and 3 panels on two threads, 30 tiles of one; m covers whole
    and partial 8-row tiles."""
    gen = torch.Generator().manual_seed(m)
    k = 96
    w = torch.randn(k, n, generator=gen).to(dtype)
    x = torch.randn(m, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    layer = cpu_ops.PackedLinear(w)
    exact = x.double() @ w.double()
    tol = {"atol": 1e-4, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-3, "rtol": 8e-3}
    torch.testing.assert_close(layer(x).double(), exact, **tol)
    torch.testing.assert_close(layer(x, bias).double(), exact + bias.double(), **tol)


@needs_gemm
@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_linear_rows_are_batch_invariant(dtype: torch.dtype, kernel_family) -> None:
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(576, 960, generator=gen).to(dtype)
    x = torch.randn(37, 576, generator=gen).to(dtype)
    layer = cpu_ops.PackedLinear(w)
    batched = layer(x)
    for r in (0, 15, 16, 36):
        assert torch.equal(layer(x[r:r + 1]), batched[r:r + 1])
    assert torch.equal(layer(x[:5]), batched[:5])


def _gguf_roundtrip(w: torch.Tensor, kind: str) -> torch.Tensor:
    """[K, N] fp32 whose columns went through a GGUF block quantiser and back, as the loader
    dequantises a Q4_0/Q4_1/Q8_0 file (blocks of 32 along K, the input dimension)."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    kind_ = GGMLQuantizationType[kind]
    rows = w.t().contiguous().numpy()  # GGUF rows are output features
    return torch.from_numpy(np.ascontiguousarray(dequantize(quantize(rows, kind_), kind_).astype(np.float32).T))


@needs_gemm
@pytest.mark.parametrize("kind,bits,k", [("Q4_1", 4, 96), ("Q4_0", 4, 96), ("Q8_0", 8, 96), ("Q4_1", 4, 1536),
                                         ("Q8_0", 8, 1536)])
def test_compact_panels_give_the_dense_results_bit_for_bit(kind: str, bits: int, k: int, kernel_family) -> None:
    """Block-quantised fp32 weights are packed as codes + per-run scale and offset and rebuilt in
    the kernel (csrc/cpu/cpu_gemm_affine.h): same outputs as the dense fp32 panels, every bit, for
    one row group and many (AVX2: block by block vs the whole panel rebuilt), several row chunks
    (K 1536, M 300) and a partial last panel, in a fraction of the bytes."""
    gen = torch.Generator().manual_seed(bits + k)
    w = _gguf_roundtrip(torch.randn(k, 70, generator=gen) * 0.05, kind)
    compact, dense = cpu_ops.PackedLinear(w), cpu_ops.PackedLinear(w, compact=False)
    assert (compact.bits_per_weight, dense.bits_per_weight) == (bits, 32)
    assert kernel_family == "best" or compact.isa == dense.isa == "avx2"
    assert compact.packed_bytes < dense.packed_bytes * (bits + 8) / 32
    bias = torch.randn(70, generator=gen)
    for m in (1, 3, 6, 7, 16, 17, 40, 300):
        x = torch.randn(m, k, generator=gen)
        assert torch.equal(compact(x), dense(x))
        assert torch.equal(compact(x, bias), dense(x, bias))
    assert torch.equal(compact(x[123:124]), dense(x)[123:124])  # a row alone == inside 300
    torch.testing.assert_close(compact(x).double(), x.double() @ w.double(), atol=1e-4, rtol=1e-5)


@needs_gemm
def test_weights_that_are_not_block_quantised_stay_dense() -> None:
    """The decomposition is checked for every weight: one value off the grid, K not a multiple of
    the 32-input run, a NaN, or plain random weights keep the whole matrix dense."""
    gen = torch.Generator().manual_seed(3)
    quantised = _gguf_roundtrip(torch.randn(64, 48, generator=gen) * 0.05, "Q4_1")
    assert cpu_ops.PackedLinear(quantised).bits_per_weight == 4
    off_grid = quantised.clone()
    off_grid[37, 20] = torch.nextafter(off_grid[37, 20], torch.tensor(1.0))
    with_nan = quantised.clone()
    with_nan[5, 3] = float("nan")
    short_k = _gguf_roundtrip(torch.randn(64, 48, generator=gen) * 0.05, "Q8_0")[:48]
    for w in (off_grid, with_nan, short_k, torch.randn(64, 48, generator=gen)):
        layer = cpu_ops.PackedLinear(w)
        assert layer.bits_per_weight == 32
        x = torch.randn(5, w.shape[0], generator=gen)
        torch.testing.assert_close(layer(x), cpu_ops.PackedLinear(w, compact=False)(x), rtol=0, atol=0, equal_nan=True)


def test_cpu_ops_report_misuse_as_value_error() -> None:
    """The C++ side returns its error messages instead of throwing (csrc/cpu/cpu_ops.h): each reaches
    Python as a ValueError, and nothing is written before the check."""
    k_cache = torch.full((2, 4, 1, 16), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    qk = torch.randn(2, 2, 16)
    v = torch.randn(2, 1, 16)
    with pytest.raises(ValueError, match="outside the cache's 8 slots"):
        cpu_ops.rope_and_cache(qk, v, None, None, k_cache, v_cache, torch.tensor([0, 8]))
    assert k_cache.isnan().all()
    with pytest.raises(ValueError, match="even K|lacks the instructions"):
        cpu_ops.PackedLinear(torch.zeros(3, 16, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="float64"):
        cpu_ops.PackedLinear(torch.zeros(4, 16, dtype=torch.float64))


@needs_gemm
def test_packed_linear_from_two_python_threads() -> None:
    """The GEMM releases the GIL and shares one C++ pool: concurrent callers (two engines in two
    threads) must each get their own, correct result."""
    import threading

    gen = torch.Generator().manual_seed(9)
    layers = [cpu_ops.PackedLinear(torch.randn(64, 64, generator=gen)) for _ in range(2)]
    inputs = [torch.randn(4, 64, generator=gen) for _ in range(2)]
    expected = [layer(x) for layer, x in zip(layers, inputs)]
    cpu_ops.kernels.set_num_threads(2)
    mismatches: list[int] = []

    def work(i: int) -> None:
        for n in range(5000):  # alternating signs: a skipped part would keep the other sign's values
            sign = 1.0 if n % 2 else -1.0
            if not torch.equal(layers[i](sign * inputs[i]), sign * expected[i]):
                mismatches.append(i)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "concurrent GEMM calls deadlocked"
    assert not mismatches
