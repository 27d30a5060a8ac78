"""The skinny decode GEMM (hipkernels/gemm/skinny_gemm.hip via pyengine.ops.cuda.skinny_gemm) against a
float64 reference, and its batch invariance.

Accuracy. The kernel sums in fp32 (another order than the reference) and rounds once to the output
dtype, so each element must lie within one ulp of the output dtype of the float64 result, plus the
fp32 summation error (2^-16 of sum |x * w|, for sums that cancel: a few hundred fp32 roundings at
most). A lost or doubled 8-row run moves a result by several ulps and fails.

Batch invariance. Each output's summation order depends on (K, N, split, tile_n) only, never on M:
a row computed alone and the same row inside a batch of M = 1..16 must be bit-identical, for the
default configuration and for every split and tile width.
"""
from __future__ import annotations

import pytest
import torch

from pyengine.ops.kernel_config import use_kernel_config

try:
    from pyengine.ops import cuda as cuda_ops
    from pyengine.ops.cuda.gemm import SKINNY_MAX_M
except ImportError:  # no GPU kernels in this build
    cuda_ops = None
    SKINNY_MAX_M = 1

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or cuda_ops is None or not hasattr(cuda_ops, "skinny_gemm"),
                       reason="needs CUDA and the skinny GEMM kernel"),
]

DEV = "cuda"
# (K, N): the Llama-3-8B projections (qkv, o, gate_up, down), then shapes with a partial column tile,
# a K of a single 8-row run and K ranges that leave threads without work.
SHAPES_8B = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]
SHAPES_SMALL = [(8, 8), (64, 72), (136, 200), (2056, 520), (4096, 8)]
CONFIGS = [(split, tile_n) for split in (1, 2, 4, 8) for tile_n in (64, 128)]
ULP = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}  # one ulp, relative to the value


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int16)


def operands(k: int, n: int, m: int, dtype: torch.dtype, seed: int, bias: bool = False):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(m, k, generator=gen, device=DEV).to(dtype)
    w = (torch.randn(k, n, generator=gen, device=DEV) * k**-0.5).to(dtype)
    b = torch.randn(n, generator=gen, device=DEV).to(dtype) if bias else None
    return x, w, b


def poisoned_run(fn, m: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """fn() after a freed NaN block of the output's size: the allocator hands it out again, so an
    element the kernel does not write stays NaN."""
    torch.full((m, n), float("nan"), dtype=dtype, device=DEV)
    return fn()


def assert_close_to_reference(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    ref = x.double() @ w.double()
    if b is not None:
        ref += b.double()
    scale = x.double().abs() @ w.double().abs()
    tol = ULP[y.dtype] * ref.abs() + 2.0**-16 * scale + 1e-30
    assert not torch.isnan(y).any(), "unwritten (NaN) or NaN outputs"
    err = (y.double() - ref).abs()
    bad = (err > tol).sum().item()
    assert bad == 0, f"{bad} of {y.numel()} outside one ulp; worst excess {(err - tol).max().item():.3g}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k,n", SHAPES_8B + SHAPES_SMALL)
def test_matches_float64_reference(k: int, n: int, dtype: torch.dtype) -> None:
    x, w, _ = operands(k, n, 16, dtype, seed=k + n)
    for m in (1, 2, 3, 4, 5, 8, 9, 16):
        y = poisoned_run(lambda: cuda_ops.skinny_gemm(x[:m], w), m, n, dtype)
        assert y.shape == (m, n) and y.dtype == dtype
        assert_close_to_reference(y, x[:m], w, None)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("split,tile_n", CONFIGS)
def test_every_configuration_matches_reference(split: int, tile_n: int, dtype: torch.dtype) -> None:
    for k, n in [(4096, 6144), (136, 200), (8, 8)]:
        x, w, b = operands(k, n, 5, dtype, seed=split * tile_n + k, bias=True)
        y = poisoned_run(lambda: cuda_ops.skinny_gemm(x, w, b, split=split, tile_n=tile_n), 5, n, dtype)
        assert_close_to_reference(y, x, w, b)


@pytest.mark.parametrize("k,n", SHAPES_8B + [(2056, 520), (64, 72)])
@pytest.mark.parametrize("config", [(0, 0)] + CONFIGS[::3])
def test_row_alone_equals_row_in_batch(k: int, n: int, config: tuple[int, int]) -> None:
    """Bit-identical rows whatever M is (1..16): the reduction order never depends on the batch."""
    split, tile_n = config
    x, w, _ = operands(k, n, 16, torch.bfloat16, seed=3 * k + n)
    alone = torch.cat([cuda_ops.skinny_gemm(x[i:i + 1], w, split=split, tile_n=tile_n) for i in range(16)])
    for m in range(1, 17):
        y = cuda_ops.skinny_gemm(x[:m], w, split=split, tile_n=tile_n)
        diff = (bits(y) != bits(alone[:m])).sum().item()
        assert diff == 0, f"M={m}: {diff} elements differ from the rows computed alone"
    # The same row at another position of a batch, with different neighbours.
    shuffled = x[torch.randperm(16, generator=torch.Generator().manual_seed(k)).to(DEV)]
    y = cuda_ops.skinny_gemm(shuffled, w, split=split, tile_n=tile_n)
    row = (shuffled == x[5]).all(dim=1).nonzero()[0, 0].item()
    assert torch.equal(bits(y[row]), bits(alone[5]))


def test_strided_rows_bias_and_fp16() -> None:
    """x rows taken from a wider buffer (as llama.py's views are), a bias, and fp16."""
    big, w, b = operands(256, 4096, 8, torch.float16, seed=7, bias=True)
    x = big.new_empty(8, 1024).normal_()[:, :256]  # row stride 1024 elements
    x.copy_(big)
    assert x.stride(0) == 1024
    y = cuda_ops.skinny_gemm(x, w, b)
    assert_close_to_reference(y, big, w, b)
    assert torch.equal(bits(y), bits(cuda_ops.skinny_gemm(big, w, b)))


def test_pdl_launch_gives_the_same_bits() -> None:
    x, w, _ = operands(4096, 4096, 3, torch.bfloat16, seed=11)
    on = cuda_ops.skinny_gemm(x, w, pdl=True)
    off = cuda_ops.skinny_gemm(x, w, pdl=False)
    assert torch.equal(bits(on), bits(off))


def test_in_a_cuda_graph() -> None:
    """Captured and replayed (the decode step's graph) with new inputs: the same bits as eager."""
    x, w, b = operands(4096, 6144, 1, torch.bfloat16, seed=13, bias=True)
    static_x = x.clone()
    cuda_ops.skinny_gemm(static_x, w, b)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = cuda_ops.skinny_gemm(static_x, w, b)
    for seed in (1, 2):
        fresh, _, _ = operands(4096, 6144, 1, torch.bfloat16, seed=seed)
        static_x.copy_(fresh)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(bits(static_y), bits(cuda_ops.skinny_gemm(fresh, w, b)))


def test_empty_and_unsupported() -> None:
    x, w, _ = operands(64, 72, 1, torch.bfloat16, seed=1)
    assert cuda_ops.skinny_gemm(x[:0], w).shape == (0, 72)
    with pytest.raises(ValueError):
        cuda_ops.skinny_gemm(x[:, :60], w[:60])  # K not a multiple of 8
    with pytest.raises(ValueError):
        cuda_ops.skinny_gemm(x, w, split=3)
    with pytest.raises(ValueError):
        cuda_ops.skinny_gemm(x.float(), w.float())
    assert cuda_ops.skinny_linear(x.float(), w.float()) is None  # cuBLAS then


def test_llama_linear_dispatch() -> None:
    """llama.linear takes the skinny GEMM up to SKINNY_MAX_M rows and cuBLAS above, and never with
    KernelConfig.skinny_gemm off."""
    from pyengine.models.layers import linear

    x, w, b = operands(4096, 6144, SKINNY_MAX_M + 1, torch.bfloat16, seed=17, bias=True)
    small = x[:SKINNY_MAX_M]
    with use_kernel_config(skinny_gemm=True):
        assert torch.equal(bits(linear(small, w, b)), bits(cuda_ops.skinny_gemm(small, w, b)))
        assert torch.equal(bits(linear(x, w, b)), bits(torch.addmm(b, x, w)))
    with use_kernel_config(skinny_gemm=False):
        assert cuda_ops.skinny_linear(small, w, b) is None
        assert torch.equal(bits(linear(small, w, b)), bits(torch.addmm(b, small, w)))


def test_prefetch_changes_no_result() -> None:
    """Pulling another weight into L2 after the GEMM (whole, or a size that is no multiple of 16
    bytes) leaves the result's bits alone."""
    x, w, b = operands(4096, 6144, 2, torch.bfloat16, seed=19, bias=True)
    nxt = torch.randn(4096, 4096, device=DEV).to(torch.bfloat16)
    plain = cuda_ops.skinny_gemm(x, w, b)
    for pf in (nxt, nxt.flatten()[:1001]):
        assert torch.equal(bits(cuda_ops.skinny_gemm(x, w, b, prefetch=pf)), bits(plain))
