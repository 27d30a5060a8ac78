"""The batch-invariant GEMM (hipkernels/gemm/invariant_gemm.hip) on the GPU: every row's bits are
the same for any number of rows and any order of rows (M 1..300 cross its 16/64/128-row tiles), at
every shape of SmolLM2 and Llama-8B; values agree with an fp32 reference; the linear dispatch runs
it for every M under KernelConfig.batch_invariant. Skips without CUDA and the kernels."""
from __future__ import annotations

import pytest
import torch

try:
    from pyengine.ops import cuda as cuda_ops
except ImportError:  # no GPU kernels in this build
    cuda_ops = None

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or cuda_ops is None, reason="needs CUDA and the GPU kernels")]

# (K, N): SmolLM2 qkv / o / gate_up / down / lm_head, Llama-8B qkv / o / gate_up / down
SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576), (576, 49152), (4096, 6144), (4096, 4096),
          (4096, 28672), (14336, 4096)]
ROW_COUNTS = [1, 2, 7, 16, 17, 63, 64, 65, 200, 257, 300]


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


@pytest.mark.parametrize("k,n", SHAPES)
def test_rows_are_batch_invariant(k: int, n: int) -> None:
    x, w, bias = operands(k, n, max(ROW_COUNTS), torch.bfloat16)
    full = cuda_ops.invariant_gemm(x, w)
    close_to_reference(full, x, w, None)
    for m in ROW_COUNTS:
        assert torch.equal(cuda_ops.invariant_gemm(x[:m], w), full[:m]), f"M={m}"
    perm = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(1)).cuda()
    assert torch.equal(cuda_ops.invariant_gemm(x[perm], w), full[perm])
    with_bias = cuda_ops.invariant_gemm(x, w, bias)
    close_to_reference(with_bias, x, w, bias)
    assert torch.equal(cuda_ops.invariant_gemm(x[:1], w, bias), with_bias[:1])


@pytest.mark.parametrize("split", [1, 2, 4, 8])
def test_every_split_and_fp16(split: int) -> None:
    for dtype in (torch.bfloat16, torch.float16):
        x, w, bias = operands(4096, 1024, 70, dtype, seed=split)
        y = cuda_ops.invariant_gemm(x, w, bias, split=split)
        close_to_reference(y, x, w, bias)
        assert torch.equal(cuda_ops.invariant_gemm(x[:3], w, bias, split=split), y[:3])


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
        with pytest.raises(ValueError):  # fp32 has no invariant GEMM: an error, not a silent cuBLAS call
            cuda_ops.linear(x.float(), w.float())
    with use_kernel_config(batch_invariant=False):
        assert cuda_ops.linear(x, w, bias) is None  # cuBLAS
