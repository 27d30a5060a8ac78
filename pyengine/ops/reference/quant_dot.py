"""The quantised-dot linear of GGUF Q4_0 / Q4_1 / Q8_0 weights on the CPU, in pure PyTorch: the
executable spec of csrc/cpu/cpu_gemm_qdot.h, equal to it bit for bit (tests/test_cpu_qdot.py).

It is llama.cpp's arithmetic for these types (int8 activations, integer dot products, one float
scale product per block), not the fp32 products of the dequantised weights:

  x, per row and 32-input block b: a = max |x_k|; d_b = a / 127; qx_k = round_half_even(x_k * (127 / a))
      (fp32 division and product); a block with a < 2^-100 is zero (d_b = 0, qx = 0), one holding
      inf or NaN has d_b = NaN and qx = 0; sx_b = d_b * sum_k qx_k.
  weights: w = s * q + m per output column and block (Q8_0: q int8, no m; Q4_0: q 0..15, m = -8 s;
      Q4_1: q 0..15, m the file's), s and m the file's fp16 values.
  y_c = acc + accm (+ bias), in fp32, blocks in order from +0, each product rounded on its own:
      acc = acc + (s_cb * d_b) * sum_k q_kc qx_k,   accm = accm + m_cb * sx_b (no accm without m).

The integer sums are exact (|sum| < 2^20), so their order is free (here float64 einsums); every
float operation is one IEEE fp32 operation in the order above, which is what makes a row's
result the same whatever else is in the batch.
"""
from __future__ import annotations

from typing import Any

import torch

BLOCK = 32
TINY_BLOCK = 2.0 ** -100  # a block whose largest magnitude is below this is quantised to zeros


def quantise_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] float32 (K % 32 == 0) -> (qx [M, K] int8, d [M, K / 32] float32, sx [M, K / 32] float32)."""
    rows, k = x.shape
    xb = x.float().reshape(rows, k // BLOCK, BLOCK)
    finite = torch.isfinite(xb).all(-1)
    amax = torch.where(finite, xb.abs().amax(-1), torch.zeros_like(xb[..., 0]))
    zero = ~finite | (amax < TINY_BLOCK)
    safe = torch.where(zero, torch.ones_like(amax), amax)
    c127 = torch.full_like(safe, 127.0)
    d = torch.where(zero, torch.zeros_like(safe), safe / c127)  # tensor by tensor: one IEEE division each
    q = torch.round(xb * (c127 / safe)[..., None])  # round half to even, like the kernel's vroundps
    q = torch.where(zero[..., None], torch.zeros_like(q), q)
    d = torch.where(finite, d, torch.full_like(d, float("nan")))
    sx = d * q.sum(-1)  # the sum of at most 32 codes is exact in float32
    return q.to(torch.int8).reshape(rows, k), d, sx


def quant_linear(x: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None, codes: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """y [M, N] float32 = x [M, K] @ W + bias, W [K, N] given per output column n as codes [N, K]
    (integers: 0..15 with an offset, int8 without), scale [N, K / 32] and offset [N, K / 32] (or
    None: Q8_0) float32, w = scale * q + offset per block."""
    rows, k = x.shape
    n, nb = scale.shape
    qx, d, sx = quantise_activations(x)
    isum = torch.einsum("mbk,nbk->mbn", qx.double().reshape(rows, nb, BLOCK),
                        codes.double().reshape(n, nb, BLOCK)).float()  # exact integers
    t = (scale.float().t()[None] * d[:, :, None]) * isum  # [M, B, N]: (s * d) then * sum, two roundings
    acc = torch.zeros(rows, n, dtype=torch.float32)
    for b in range(nb):
        acc = acc + t[:, b]
    if offset is not None:
        u = offset.float().t()[None] * sx[:, :, None]
        accm = torch.zeros(rows, n, dtype=torch.float32)
        for b in range(nb):
            accm = accm + u[:, b]
        acc = acc + accm
    if bias is not None:
        acc = acc + bias.float()
    return acc


def gguf_weight_codes(blocks: Any) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(scale, offset, codes) of a Q4_0 / Q4_1 / Q8_0 tensor taken apart by
    pyengine.loader.gguf_dequant.decode (rows = output columns), as quant_linear takes them."""
    scale = torch.from_numpy(blocks.scale.astype("float32"))
    raw = torch.from_numpy(blocks.codes.copy())
    rows, nb = scale.shape
    if blocks.kind == "q8":
        return scale, None, raw.to(torch.int16).reshape(rows, nb * BLOCK)
    nibbles = torch.cat([raw & 0x0F, raw >> 4], dim=-1)  # byte j: input j (low), input j + 16 (high)
    offset = -8.0 * scale if blocks.offset is None else torch.from_numpy(blocks.offset.astype("float32"))
    return scale, offset, nibbles.to(torch.int16).reshape(rows, nb * BLOCK)
