"""CUDA GEMMs of pyengine, w in llama.py's [in, out] layout: the skinny GEMM for decode
(hipkernels/gemm/skinny_gemm.hip; why a GEMM of its own and where it wins: docs/kernels/layer_ops.md)
and the batch-invariant GEMMs that every projection runs under KernelConfig.batch_invariant: tensor
cores for fp16/bf16 (hipkernels/gemm/invariant_gemm.hip), CUDA-core FMAs for fp32
(hipkernels/gemm/invariant_gemm_f32.hip). `linear` picks among them and cuBLAS."""
from __future__ import annotations

import torch

from pyengine.ops.cuda.launch import aligned_rows, kernels, num_sms, params, row_stride, stream
from pyengine.ops.kernel_config import get_kernel_config

# Rows up to which skinny_linear takes a projection (above it cuBLAS is faster on the H100).
SKINNY_MAX_M = 1
_SKINNY_DTYPES = {torch.float16: 0, torch.bfloat16: 1}


def skinny_gemm(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, *, split: int = 0,
                tile_n: int = 0, pdl: bool | None = None, prefetch: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ w [K, N] (+ bias [N]) -> [M, N] in x's dtype (fp16/bf16, fp32 accumulation, one
    rounding). w is llama.py's [in, out] weight, contiguous. Each output's summation order depends on
    (K, N, split, tile_n) only: a row's result is the same alone and in any batch. split (1, 2, 4, 8)
    and tile_n (64, 128): 0 takes the default for the shape; benchmarks sweep them. pdl: None takes
    the KernelConfig's. prefetch: a contiguous tensor (the weight a later GEMM reads) pulled into L2
    once this one's work is done."""
    bias = _checked_operands("skinny_gemm", x, w, bias)
    m, k, n = x.shape[0], x.shape[1], w.shape[1]
    bias_ptr = 0 if bias is None else bias.data_ptr()
    pf_ptr = pf_bytes = 0
    if prefetch is not None and prefetch.device == x.device and prefetch.is_contiguous() and prefetch.data_ptr() % 16 == 0:
        pf_ptr, pf_bytes = prefetch.data_ptr(), prefetch.numel() * prefetch.element_size() // 16 * 16
    x = aligned_rows(x)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    p = params(kernels.SkinnyGemmParams, x=x.data_ptr(), w=w.data_ptr(), bias=bias_ptr, y=y.data_ptr(), m=m, n=n,
               k=k, x_stride=row_stride(x), y_stride=row_stride(y), dtype=_SKINNY_DTYPES[x.dtype],
               num_sms=num_sms(x.device), split=split, tile_n=tile_n,
               pdl=get_kernel_config().pdl if pdl is None else pdl, prefetch=pf_ptr, prefetch_bytes=pf_bytes)
    with torch.cuda.device(x.device):
        kernels.skinny_gemm(p, stream(x.device))
    return y


def invariant_gemm(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, *, split: int = 0,
                   pdl: bool | None = None) -> torch.Tensor:
    """x [M, K] @ w [K, N] (+ bias [N]) -> [M, N] in x's dtype (fp16/bf16, fp32 accumulation, one
    rounding), on tensor cores for any M. Each output's summation order depends on (K, N, split)
    only, never on M: a row's result is the same alone and in any batch. split (1, 2, 4, 8): 0 takes
    the default for the shape (kernels.invariant_gemm_split). NVIDIA only."""
    bias = _checked_operands("invariant_gemm", x, w, bias)
    m, k, n = x.shape[0], x.shape[1], w.shape[1]
    if k % 64:
        raise ValueError(f"invariant_gemm needs K a multiple of 64, got {tuple(w.shape)}")
    x = aligned_rows(x)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    p = params(kernels.InvariantGemmParams, x=x.data_ptr(), w=w.data_ptr(), bias=0 if bias is None else bias.data_ptr(),
               y=y.data_ptr(), m=m, n=n, k=k, x_stride=row_stride(x), y_stride=row_stride(y), dtype=_SKINNY_DTYPES[x.dtype],
               num_sms=num_sms(x.device), split=split, pdl=get_kernel_config().pdl if pdl is None else pdl)
    with torch.cuda.device(x.device):
        kernels.invariant_gemm(p, stream(x.device))
    return y


def invariant_gemm_f32(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, *,
                       split: int = 0) -> torch.Tensor:
    """x [M, K] @ w [K, N] (+ bias [N]) -> [M, N], fp32 in and out: exact fp32 products (FMA, no
    TF32) summed over k in increasing order within each of `split` K ranges, the ranges then added
    in order, bias last. The order depends on (K, N, split) only, never on M: a row's result is the
    same alone and in any batch. split (1, 2, 4, 8): 0 takes the default for the shape
    (kernels.invariant_gemm_f32_split). Any strides and alignment (x's last dim is made contiguous)."""
    if x.device.type != "cuda" or w.device != x.device:
        raise ValueError(f"invariant_gemm_f32 needs x and w on one CUDA device, got {x.device} / {w.device}")
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[0] or x.shape[1] == 0:
        raise ValueError(f"x must be [M, K] and w [K, N] with K > 0, got {tuple(x.shape)} / {tuple(w.shape)}")
    if x.dtype != torch.float32 or w.dtype != torch.float32:
        raise ValueError(f"invariant_gemm_f32 takes fp32 x and w, got {x.dtype} / {w.dtype}")
    if not w.is_contiguous():
        raise ValueError(f"w must be contiguous, got strides {w.stride()}")
    m, k, n = x.shape[0], x.shape[1], w.shape[1]
    if bias is not None:
        if bias.device != x.device or tuple(bias.shape) != (n,) or bias.dtype != torch.float32:
            raise ValueError(f"bias must be [{n}] fp32 on {x.device}, got {tuple(bias.shape)} {bias.dtype}")
        bias = bias.contiguous()
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty(m, n, dtype=torch.float32, device=x.device)
    sms = num_sms(x.device)
    ws_floats = kernels.invariant_gemm_f32_workspace(m, n, k, sms, split)
    # referenced until the launch: a freed block could be handed to the next allocation first
    ws = torch.empty(ws_floats, dtype=torch.float32, device=x.device) if ws_floats else None
    p = params(kernels.InvariantGemmF32Params, x=x.data_ptr(), w=w.data_ptr(), bias=0 if bias is None else bias.data_ptr(),
               y=y.data_ptr(), workspace=0 if ws is None else ws.data_ptr(), m=m, n=n, k=k, x_stride=row_stride(x),
               y_stride=row_stride(y), num_sms=sms, split=split)
    with torch.cuda.device(x.device):
        kernels.invariant_gemm_f32(p, stream(x.device))
    return y


def _checked_operands(name: str, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """Validates the operands of pyengine's GEMMs; returns bias contiguous (or None)."""
    if x.device.type != "cuda" or w.device != x.device:
        raise ValueError(f"{name} needs x and w on one CUDA device, got {x.device} / {w.device}")
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[0]:
        raise ValueError(f"x must be [M, K] and w [K, N], got {tuple(x.shape)} / {tuple(w.shape)}")
    if x.dtype not in _SKINNY_DTYPES or w.dtype != x.dtype:
        raise ValueError(f"{name} takes fp16/bf16 x and w of one dtype, got {x.dtype} / {w.dtype}")
    if not w.is_contiguous() or w.data_ptr() % 16 or x.shape[1] % 8 or w.shape[1] % 8:
        raise ValueError(f"w must be contiguous and 16-byte aligned with K, N multiples of 8, got {tuple(w.shape)}")
    if bias is None:
        return None
    n = w.shape[1]
    if bias.device != x.device or tuple(bias.shape) != (n,) or bias.dtype != x.dtype:
        raise ValueError(f"bias must be [{n}] {x.dtype} on {x.device}, got {tuple(bias.shape)} {bias.dtype}")
    return bias.contiguous()


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """x @ w (+ bias) on pyengine's GEMMs, or None: the caller runs cuBLAS. Under
    KernelConfig.batch_invariant every call runs an invariant GEMM - fp32 operands the fp32 one
    (invariant_gemm_f32, NVIDIA and AMD), fp16/bf16 the tensor-core one (NVIDIA; elsewhere the
    skinny GEMM, whose order is M-invariant too) - and a projection none takes is an error, not a
    silent cuBLAS call; otherwise single-row calls take the skinny GEMM (skinny_linear)."""
    if not get_kernel_config().batch_invariant:
        return skinny_linear(x, w, bias)
    if x.dtype == torch.float32 and w.dtype == torch.float32:
        return invariant_gemm_f32(x, w, bias)
    if torch.version.hip is None:
        return invariant_gemm(x, w, bias)
    return skinny_gemm(x, w, bias)


def skinny_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """x @ w (+ bias) through skinny_gemm where it is the faster choice (KernelConfig.skinny_gemm, few
    rows, fp16/bf16, the layout and alignment it takes), else None: the caller then runs cuBLAS.
    No L2 prefetch (measured no faster: docs/kernels/layer_ops.md)."""
    if (not get_kernel_config().skinny_gemm or x.dim() != 2 or x.shape[0] > SKINNY_MAX_M
            or x.dtype not in _SKINNY_DTYPES or w.dtype != x.dtype or w.dim() != 2 or not w.is_contiguous()
            or w.data_ptr() % 16 or x.shape[1] != w.shape[0] or x.shape[1] % 8 or w.shape[1] % 8
            or x.device != w.device or (bias is not None and bias.dtype != x.dtype)):
        return None
    return skinny_gemm(x, w, bias)


def grouped_gemm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor | None = None, *, split: int = 0,
                 pdl: bool | None = None) -> torch.Tensor:
    """The batch-invariant GEMM over groups of rows, one weight per group (w [G, K, N] contiguous,
    [in, out] per group), fp16/bf16, NVIDIA (hipkernels/gemm/grouped_gemm.h):
      offs int32 [G] (cumulative row counts, torch._grouped_mm's offs): x [M, K] rows sorted by
        group -> y [M, N], y[r] = x[r] @ w[g(r)]; rows past offs[-1] are left unwritten. No host
        synchronisation: the counts stay on the device.
      offs None: x [T, G, K] (group g is x[:, g]; any token and group strides) -> y [T, G, N].
    Each row's bits equal invariant_gemm(row, w[g]) alone (same K split, same order), whatever
    the other groups' rows. split: 0 takes invariant_gemm's for (K, N)."""
    g, k, n = w.shape
    if x.dtype not in _SKINNY_DTYPES or w.dtype != x.dtype:
        raise ValueError(f"grouped_gemm takes fp16/bf16 x and w of one dtype, got {x.dtype} / {w.dtype}")
    if k % 64 or n % 8 or not w.is_contiguous() or w.data_ptr() % 16:
        raise ValueError(f"grouped_gemm needs w contiguous and 16-byte aligned with K a multiple of 64 and N of 8, "
                         f"got {tuple(w.shape)}")
    x = aligned_rows(x)
    if offs is None:
        y = torch.empty(x.shape[0], g, n, dtype=x.dtype, device=x.device)
        rows, x_group, y_group = x.shape[0], row_stride(x, 1), row_stride(y, 1)
    else:
        offs = offs.contiguous()
        y = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
        rows, x_group, y_group = x.shape[0], 0, 0
    if rows == 0:
        return y
    p = params(kernels.GroupedGemmParams, x=x.data_ptr(), w=w.data_ptr(), y=y.data_ptr(),
               offs=0 if offs is None else offs.data_ptr(), num_groups=g, m=rows, n=n, k=k, x_stride=row_stride(x),
               y_stride=row_stride(y), x_group_stride=x_group, y_group_stride=y_group, dtype=_SKINNY_DTYPES[x.dtype],
               num_sms=num_sms(x.device), split=split, pdl=get_kernel_config().pdl if pdl is None else pdl)
    with torch.cuda.device(x.device):
        kernels.grouped_gemm(p, stream(x.device))
    return y


def grouped_linear(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor | None = None) -> torch.Tensor | None:
    """ops.grouped_linear on CUDA (validated by the facade): the grouped kernel for fp16/bf16 on
    NVIDIA; None elsewhere (AMD: the kernel is mma.sync-only; fp32): the facade then runs the
    groups one at a time through linear()."""
    if torch.version.hip is not None or x.dtype not in _SKINNY_DTYPES:
        return None
    return grouped_gemm(x, w, offs)
