"""The batch-invariant GEMMs (hipkernels/gemm/invariant_gemm.hip, fp16/bf16: the wgmma family
invariant_gemm_wgmma.hip that invariant_gemm runs on sm_90a builds for large weights above 16 or 64
rows and for every weight above 256, and the mma.sync family that runs the rest and the grouped
GEMM, reached with family=1;
invariant_gemm_f32.hip, fp32) on the GPU: every row's bits are the same for any number of rows and
any order of rows (M 1..300 and 4096 cross the families, the output tiles, the cluster / one-block
combines and the fp32 kernel's workspace / one-block paths; every tile forced), at every shape
of SmolLM2 and Llama-8B; values agree with a wider reference; the linear dispatch runs them for
every M under KernelConfig.batch_invariant. Skips without CUDA and the kernels."""
from __future__ import annotations

import pytest
import torch

try:
    from pyengine.ops import cuda as cuda_ops
    from pyengine.ops.cuda.gemm import invariant_gemm_f32
    from pyengine.ops.cuda.launch import aligned_rows, kernels, num_sms, params, row_stride, stream
except ImportError:  # no GPU kernels in this build
    cuda_ops = None

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or cuda_ops is None, reason="needs CUDA and the GPU kernels")]

# (K, N): SmolLM2 qkv / o / gate_up / down / lm_head, Llama-8B qkv / o / gate_up / down
SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576), (576, 49152), (4096, 6144), (4096, 4096),
          (4096, 28672), (14336, 4096)]
ROW_COUNTS = [1, 2, 7, 16, 17, 63, 64, 65, 200, 257, 300]
# InvariantGemmParams.family: 0 the default (wgmma on sm_90a builds for weights of >= 2^23 elements
# above 16 or 64 rows and for smaller ones above 256, invariant_gemm_wgmma_default_for; else
# mma.sync: the two give the same bits),
# 1 mma.sync, 2 wgmma wherever built
FAMILIES = {"default": 0, "mma_sync": 1, "wgmma": 2}


def gemm(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, *, split: int = 0,
         family: int = 0, tile: tuple[int, int] = (0, 0)) -> torch.Tensor:
    """cuda_ops.invariant_gemm with the kernel family named (family 0 is what it runs) and its
    output tile (rows, columns; 0 the default): any mma.sync tile, or the wgmma family's width
    (tile (0, 128) or (0, 256))."""
    if family == 0 and tile == (0, 0):
        return cuda_ops.invariant_gemm(x, w, bias, split=split)
    x = aligned_rows(x)
    y = torch.empty(x.shape[0], w.shape[1], dtype=x.dtype, device=x.device)
    p = params(kernels.InvariantGemmParams, x=x.data_ptr(), w=w.data_ptr(), bias=0 if bias is None else bias.data_ptr(),
               y=y.data_ptr(), m=x.shape[0], n=w.shape[1], k=x.shape[1], x_stride=row_stride(x),
               y_stride=row_stride(y), dtype=1 if x.dtype == torch.bfloat16 else 0, num_sms=num_sms(x.device),
               split=split, family=family, tile_m=tile[0], tile_n=tile[1])
    with torch.cuda.device(x.device):
        kernels.invariant_gemm(p, stream(x.device))
    return y


def operands(k: int, n: int, m: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", generator=g).to(dtype)
    w = (torch.randn(k, n, device="cuda", generator=g) / k ** 0.5).to(dtype)
    bias = torch.randn(n, device="cuda", generator=g).to(dtype)
    return x, w, bias


def close_to_reference(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> None:
    ref = x.float() @ w.float() + (0 if bias is None else bias.float())
    # one rounding of an fp32 sum to 16 bits, plus fp32 reordering (K <= 14336): a few ulps
    tol = 2 ** -7 if y.dtype == torch.bfloat16 else 2 ** -10
    err = (y.float() - ref).abs() / (ref.abs() + 1.0)
    assert float(err.max()) <= 2 * tol, float(err.max())


@pytest.mark.parametrize("family", FAMILIES.values(), ids=FAMILIES.keys())
@pytest.mark.parametrize("k,n", SHAPES)
def test_rows_are_batch_invariant(k: int, n: int, family: int) -> None:
    """Rows of M = 4096 (the one-block walk over K ranges) == the same rows computed in batches of
    1..300 (decode and cluster launches) == shuffled == one row alone at an odd position."""
    x, w, bias = operands(k, n, 4096, torch.bfloat16)
    full = gemm(x, w, family=family)
    close_to_reference(full[:300], x[:300], w, None)
    close_to_reference(full[-64:], x[-64:], w, None)
    for m in ROW_COUNTS:
        assert torch.equal(gemm(x[:m], w, family=family), full[:m]), f"M={m}"
        assert torch.equal(gemm(x[4096 - m:], w, family=family), full[4096 - m:]), f"last {m} rows"
    perm = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(1)).cuda()
    assert torch.equal(gemm(x[perm], w, family=family), full[perm])
    assert torch.equal(gemm(x[1001:1002], w, family=family), full[1001:1002])
    with_bias = gemm(x[:300], w, bias, family=family)
    close_to_reference(with_bias, x[:300], w, bias)
    assert torch.equal(gemm(x[:1], w, bias, family=family), with_bias[:1])


@pytest.mark.parametrize("family", [0, 2], ids=["default", "wgmma"])
@pytest.mark.parametrize("k,n", [(576, 960), (4096, 6144)])
def test_every_m_up_to_300(k: int, n: int, family: int) -> None:
    """M = 1..300 one by one (every tail of the row tiles; the default crosses from mma.sync to
    wgmma at 65 rows on Llama-8B's qkv, at 257 on SmolLM2's)."""
    x, w, _ = operands(k, n, 300, torch.bfloat16, seed=2)
    full = gemm(x, w, family=family)
    for m in range(1, 301):
        assert torch.equal(gemm(x[:m], w, family=family), full[:m]), f"M={m}"


@pytest.mark.parametrize("k,n", SHAPES[:4])
def test_small_weights_at_prefill_sizes(k: int, n: int) -> None:
    """SmolLM2's qkv / o / gate_up / down: mma.sync up to 256 rows, wgmma above, its width (128,
    192, 256) from the waves of blocks at that M (invariant_gemm_wgmma_wide_for). Rows of M = 256,
    257, 512, 1024 and 2048, first and last, give the bits of M = 4096, which equal mma.sync's."""
    x, w, bias = operands(k, n, 4096, torch.bfloat16, seed=k + n + 3)
    full = gemm(x, w, bias)
    assert torch.equal(full, gemm(x, w, bias, family=1))
    close_to_reference(full, x, w, bias)
    for m in (256, 257, 512, 1024, 2048):
        assert torch.equal(gemm(x[:m], w, bias), full[:m]), f"M={m}"
        assert torch.equal(gemm(x[4096 - m:], w, bias), full[4096 - m:]), f"last {m} rows"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("k,n", SHAPES)
def test_the_families_give_the_same_bits(k: int, n: int, dtype: torch.dtype) -> None:
    """The default picks mma.sync up to 16 rows and wgmma above 16 or 64 rows for large weights, above
    256 for small ones: a row keeps its bits across those lines only because both families give the same bits for the
    same K ranges (the same tensor-core sums per 16-wide k step, the same order after). Measured
    here, not documented: every shape, split and row-tile path, rows from a decode step to a
    prefill chunk."""
    x, w, bias = operands(k, n, 2200, dtype, seed=k + n)
    for split in (0, 1, 2, 4, 8):
        for m in (1, 64, 300, 2200):
            a = gemm(x[:m], w, bias, split=split, family=1)
            b = gemm(x[:m], w, bias, split=split, family=2)
            assert torch.equal(a, b), f"split {split}, M={m}: {(a != b).sum().item()} elements differ"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("k,n", [(4096, 28672), (576, 49152), (4096, 1024), (14336, 4096), (128, 968), (192, 200),
                                 (640, 136), (64, 8)])
def test_the_wide_wgmma_tiles_give_the_same_bits(k: int, n: int, dtype: torch.dtype) -> None:
    """The wgmma family's 128 x 256 tile (one K range: split 1) and 128 x 192 tile (one range, or
    a block walking them: splits 2 / 8, empty ranges where K is short), forced at every M from one
    row to several row tiles, with bias and at column tails, give the bits of the 128-wide wgmma
    tile and of mma.sync. (By default they run from 65 rows at split 1 and from 257 rows where
    the 128-wide tile would walk the ranges: Llama-8B's projections in a prefill.)"""
    x, w, bias = operands(k, n, 600, dtype, seed=k + n + 1)
    for split in (1, 2, 8):
        widths = (128, 192, 256) if split == 1 else (128, 192)
        for m in (1, 17, 64, 65, 129, 300, 600):
            ref = gemm(x[:m], w, bias, split=split, family=1)
            for width in widths:
                y = gemm(x[:m], w, bias, split=split, family=2, tile=(0, width))
                assert torch.equal(y, ref), f"split {split}, {width}-wide, M={m}: {(y != ref).sum().item()} differ"
        close_to_reference(y, x, w, bias)
    assert torch.equal(gemm(x, w, split=1, family=2, tile=(0, 256)), gemm(x, w, split=1, family=1))


@pytest.mark.parametrize("family", FAMILIES.values(), ids=FAMILIES.keys())
@pytest.mark.parametrize("split", [1, 2, 4, 8])
def test_every_split_and_fp16(split: int, family: int) -> None:
    """Every split through the decode tile, the cluster combine (70 rows) and the one-block walk
    (2200 rows x 8 column tiles: more tiles than an H100 has SMs); K 256 at split 8 leaves empty ranges."""
    for dtype in (torch.bfloat16, torch.float16):
        for k in (4096, 256):
            x, w, bias = operands(k, 1024, 2200, dtype, seed=split)
            y = gemm(x, w, bias, split=split, family=family)
            close_to_reference(y, x, w, bias)
            assert torch.equal(gemm(x[:3], w, bias, split=split, family=family), y[:3])
            assert torch.equal(gemm(x[:70], w, bias, split=split, family=family), y[:70])


@pytest.mark.parametrize("family", FAMILIES.values(), ids=FAMILIES.keys())
@pytest.mark.parametrize("k,n", [(64, 8), (128, 968), (192, 200), (640, 136)])
def test_tails(k: int, n: int, family: int) -> None:
    """N not a multiple of the 128-column tile, K of one to a few k tiles, M across the row tiles."""
    x, w, bias = operands(k, n, 333, torch.float16, seed=k)
    y = gemm(x, w, bias, family=family)
    close_to_reference(y, x, w, bias)
    for m in (1, 5, 64, 65, 129, 200):
        assert torch.equal(gemm(x[-m:], w, bias, family=family), y[-m:]), f"M={m}"


# The mma.sync family's output tiles (rows, columns): a launch choice from M and the shape, never
# part of a row's sums
TILES = [(16, 32), (16, 64), (16, 128), (64, 32), (64, 64), (64, 128), (128, 128)]


@pytest.mark.parametrize("split", [0, 1, 2, 4, 8])
@pytest.mark.parametrize("k,n", [(576, 960), (1536, 576), (4096, 1024), (192, 200), (640, 136)])
def test_every_tile_gives_the_same_bits(k: int, n: int, split: int) -> None:
    """Every output tile, forced, gives each row the bits of the default launch (M 1 to 300, column
    tails of the 32-, 64- and 128-wide tiles, empty K ranges at split 8), and values close to fp32."""
    x, w, bias = operands(k, n, 300, torch.bfloat16, seed=k + split)
    full = gemm(x, w, bias, split=split)
    close_to_reference(full, x, w, bias)
    for tile in TILES:
        for m in (1, 17, 64, 300):
            y = gemm(x[:m], w, bias, split=split, family=1, tile=tile)
            assert torch.equal(y, full[:m]), f"tile {tile}, M={m}: {(y != full[:m]).sum().item()} elements differ"


def test_strided_rows_and_errors() -> None:
    x, w, _ = operands(576, 960, 40, torch.bfloat16)
    wide = torch.zeros(40, 640, dtype=x.dtype, device="cuda")
    wide[:, :576] = x
    assert torch.equal(cuda_ops.invariant_gemm(wide[:, :576], w), cuda_ops.invariant_gemm(x, w))
    with pytest.raises(ValueError, match="multiple of 64"):
        cuda_ops.invariant_gemm(x[:, :544], w[:544])
    with pytest.raises(ValueError, match="fp16/bf16"):
        cuda_ops.invariant_gemm(x.float(), w.float())


def test_linear_runs_it_for_every_m_only_when_invariant() -> None:
    from pyengine.ops.kernel_config import use_kernel_config

    x, w, bias = operands(576, 960, 33, torch.bfloat16)
    with use_kernel_config(batch_invariant=True):
        y = cuda_ops.linear(x, w, bias)
        assert torch.equal(y, cuda_ops.invariant_gemm(x, w, bias))
        assert torch.equal(cuda_ops.linear(x[:1], w, bias), y[:1])
        assert torch.equal(cuda_ops.linear(x.float(), w.float()), invariant_gemm_f32(x.float(), w.float()))
        with pytest.raises(ValueError):  # mixed dtypes: no invariant GEMM takes them, an error, not a cuBLAS call
            cuda_ops.linear(x.float(), w)
    with use_kernel_config(batch_invariant=False):
        assert cuda_ops.linear(x, w, bias) is None  # cuBLAS


# ---- fp32 (invariant_gemm_f32): exact fp32 products, sums in an order fixed by (K, N, split) ----------
F32_SHAPES = SHAPES[:5] + [(4096, 4096), (14336, 4096), (100, 37), (7, 1)]  # + odd shapes: no alignment needed


def close_to_fp64(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> None:
    """fp32 sums of K exact products: error within K ulps of the sum of |terms| (a loose bound)."""
    ref = x.double() @ w.double() + (0 if bias is None else bias.double())
    scale = x.double().abs() @ w.double().abs() + (0 if bias is None else bias.double().abs())
    err = (y.double() - ref).abs()
    assert bool((err <= x.shape[1] * 2 ** -23 * scale + 1e-30).all()), float((err / (scale + 1e-30)).max())


@pytest.mark.parametrize("k,n", F32_SHAPES)
def test_f32_rows_are_batch_invariant(k: int, n: int) -> None:
    x, w, bias = operands(k, n, max(ROW_COUNTS), torch.float32)
    full = invariant_gemm_f32(x, w, bias)
    close_to_fp64(full, x, w, bias)
    for m in list(range(1, 34)) + ROW_COUNTS:
        assert torch.equal(invariant_gemm_f32(x[:m], w, bias), full[:m]), f"M={m}"
    perm = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(1)).cuda()
    assert torch.equal(invariant_gemm_f32(x[perm], w, bias), full[perm])
    assert torch.equal(invariant_gemm_f32(x[5:6], w, bias), full[5:6])  # a lone row at an odd offset


@pytest.mark.parametrize("split", [1, 2, 4, 8])
def test_f32_every_split_and_both_paths(split: int) -> None:
    """Few output tiles (M 3: one block per K range, workspace, combine) and many (M 300 x N 2048:
    one block walks every range) give the same rows; values close to fp64 for every split."""
    x, w, bias = operands(4096, 2048, 300, torch.float32, seed=split)
    y = invariant_gemm_f32(x, w, bias, split=split)
    close_to_fp64(y, x, w, bias)
    assert torch.equal(invariant_gemm_f32(x[:3], w, bias, split=split), y[:3])
    assert torch.equal(invariant_gemm_f32(x[:1], w, split=split), invariant_gemm_f32(x, w, split=split)[:1])


def test_f32_strided_rows_and_errors() -> None:
    x, w, _ = operands(576, 960, 40, torch.float32)
    wide = torch.zeros(40, 600, device="cuda")
    wide[:, 3:579] = x  # rows 600 apart, starting 12 bytes in: no alignment
    assert torch.equal(invariant_gemm_f32(wide[:, 3:579], w), invariant_gemm_f32(x, w))
    with pytest.raises(ValueError, match="fp32"):
        invariant_gemm_f32(x.bfloat16(), w.bfloat16())
    with pytest.raises(ValueError, match="contiguous"):
        invariant_gemm_f32(x, w.t().contiguous().t())
