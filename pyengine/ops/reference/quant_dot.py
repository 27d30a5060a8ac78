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

act_bits=32 (KernelConfig.cpu_int16_dot; csrc/cpu/cpu_gemm_qdot16.cpp) takes 32767 for 127 and
two int16 limbs per input, x_k ~ d_b * (q1_k + q2_k * 2^-15):
  p_k = x_k * (32767 / a) (fp32), q1_k = rne(p_k), q2_k = rne((p_k - q1_k) * 2^15) (both steps
      exact but the rounding; |q2| <= 16384); sx_b = d_b * (sum q1 + sum q2 * 2^-15) (one rounding);
  per block and column f = float(sum q q1) + float(sum q q2) * 2^-15 (one rounding of the add; the
      int-to-float conversions round to nearest even where a sum passes 2^24: 8-bit codes only);
      acc = acc + (s_cb * d_b) * f.
The error of x_k as the limbs hold it is at most a / 32767 * 2^-16 (2^-31 of the block's largest
magnitude), under fp32's own rounding of the products: the dequantised weights' fp32 products
but for rounding.
"""
from __future__ import annotations

from typing import Any

import torch

BLOCK = 32
TINY_BLOCK = 2.0 ** -100  # a block whose largest magnitude is below this is quantised to zeros
INT8_LEVELS, INT16_LEVELS = 127, 32767
LIMB = 32768.0  # the second int16 limb's scale (act_bits 32)


def quantise_activations(x: torch.Tensor, act_bits: int = 8) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] float32 (K % 32 == 0) -> (qx, d [M, K / 32] float32, sx [M, K / 32] float32); qx
    [M, K] int8 (act_bits 8) or [2, M, K] int16, the two limbs (act_bits 32)."""
    levels = INT8_LEVELS if act_bits == 8 else INT16_LEVELS
    rows, k = x.shape
    xb = x.float().reshape(rows, k // BLOCK, BLOCK)
    finite = torch.isfinite(xb).all(-1)
    amax = torch.where(finite, xb.abs().amax(-1), torch.zeros_like(xb[..., 0]))
    zero = ~finite | (amax < TINY_BLOCK)
    safe = torch.where(zero, torch.ones_like(amax), amax)
    c = torch.full_like(safe, float(levels))
    d = torch.where(zero, torch.zeros_like(safe), safe / c)  # tensor by tensor: one IEEE division each
    p = xb * (c / safe)[..., None]
    q = torch.round(p)  # round half to even, like the kernel's vroundps
    q = torch.where(zero[..., None], torch.zeros_like(q), q)
    d = torch.where(finite, d, torch.full_like(d, float("nan")))
    if act_bits == 8:
        sx = d * q.sum(-1)  # the sum of at most 32 codes is exact in float32
        return q.to(torch.int8).reshape(rows, k), d, sx
    assert act_bits == 32, act_bits
    q2 = torch.round((p - q) * LIMB)  # p - q and the product by 2^15 are exact
    q2 = torch.where(zero[..., None], torch.zeros_like(q2), q2)
    sx = d * (q.sum(-1) + q2.sum(-1) * (1.0 / LIMB))  # exact sums and product, one rounding of the add
    return torch.stack([q, q2]).to(torch.int16).reshape(2, rows, k), d, sx


def _block_sums(qx: torch.Tensor, codes: torch.Tensor, nb: int) -> torch.Tensor:
    """[M, B, N] float32: sum_k q_kn qx_k per block, exact in float64 then one rounding to float32."""
    rows, n = qx.shape[0], codes.shape[0]
    return torch.einsum("mbk,nbk->mbn", qx.double().reshape(rows, nb, BLOCK),
                        codes.double().reshape(n, nb, BLOCK)).float()


def quant_linear(x: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None, codes: torch.Tensor,
                 bias: torch.Tensor | None = None, act_bits: int = 8) -> torch.Tensor:
    """y [M, N] float32 = x [M, K] @ W + bias, W [K, N] given per output column n as codes [N, K]
    (integers: 0..15 with an offset, int8 without), scale [N, K / 32] and offset [N, K / 32] (or
    None: Q8_0) float32, w = scale * q + offset per block; x as act_bits 8 (int8) or 32 (two int16
    limbs) codes per block."""
    rows, k = x.shape
    n, nb = scale.shape
    qx, d, sx = quantise_activations(x, act_bits)
    if act_bits == 32:
        isum = _block_sums(qx[0], codes, nb) + _block_sums(qx[1], codes, nb) * (1.0 / LIMB)  # one rounding
    else:
        isum = _block_sums(qx, codes, nb)
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
