// The GEMM of GGUF Q4_0 / Q4_1 / Q8_0 weights packed from their codes, in llama.cpp's arithmetic:
// activations quantised per 32-input block to int8, exact integer dot products, fp32 scales.
//
// Why: rebuilding each fp32 weight (cpu_gemm_affine.h) costs one FMA per weight and a product
// another; a batch-1 step was bound by that work, not by memory. Here 32 products of a block are
// integer multiply-adds (AVX2 vpmaddubsw / vpmaddwd) and the floats come in once per block.
//
// What a row computes (pyengine/ops/reference/quant_dot.py is the executable spec, bit for bit):
//   x, per 32-input block b: a = max |x_k|; d_b = a / 127, qx_k = rne(x_k * (127 / a)) in
//     [-127, 127] (fp32 division and product, round half to even); a block with a < 2^-100 is
//     zero (d_b = 0, qx = 0); a block holding inf or NaN gives d_b = NaN (the row's outputs NaN).
//     sx_b = d_b * float(sum_k qx_k).
//   weights w = s * q + m per column and block (Q8_0: m = 0, q int8; Q4_0: q 0..15, m = -8 s;
//     Q4_1: q 0..15), s and m the file's fp16 values.
//   per output column c, blocks in order from +0, each product rounded before its add (no FMA):
//     acc += (s_cb * d_b) * float(sum_k q_kc qx_k);   accm += m_cb * sx_b   (4-bit only)
//   y = acc + accm (4-bit) or acc (8-bit), then + bias.
// Integer sums are exact (no overflow: |sum| < 2^20), so every kernel, row group, row chunk and
// thread count gives a row the same bits: the row's result depends on the row alone.
//
// Layout (one stream per panel of 16 columns, its K / 32 blocks in order):
//   4-bit block, 320 bytes: s fp16[16], m fp16[16], then 8 groups of 32 bytes, group g for
//     inputs 4g .. 4g + 3: byte 4c + i holds input 4g + i of column c (low nibble) and of
//     column c + 8 (high nibble), c < 8 - what vpmaddubsw pairs with 4 bytes of x broadcast.
//   8-bit block, 544 bytes: s fp16[16], then 8 groups of 64 bytes: columns 0-7 (byte 4c + i:
//     input 4g + i of column c), then columns 8-15.
// The kernels are AVX2 (+ FMA, F16C) on every x86-64 CPU that has them; the int16x2 ones also run
// on AVX-512 VNNI and AMX-INT8 where the CPU has them, with the same bits: the bits do not depend
// on the machine.
//
// int16x2 activations (act_bits 32, cpu_gemm_qdot16.cpp; spec: quant_dot.py, act_bits=32), the
// same panels: each input as two int16 limbs, x_k ~ d_b * (q1_k + q2_k * 2^-15):
//   d_b = a / 32767, p_k = x_k * (32767 / a) (fp32), q1_k = rne(p_k) in [-32767, 32767],
//   q2_k = rne((p_k - q1_k) * 2^15) in [-16384, 16384] (the subtraction and product are exact);
//   the tiny / non-finite block rules as above; sx_b = d_b * (sum q1 + sum q2 * 2^-15), the add
//   rounded once. Per column and block, i = sum q q1, j = sum q q2 (vpmaddwd, exact:
//   |sum| < 2^28), f = float(i) + float(j) * 2^-15 (conversions round to nearest even, exact for
//   4-bit codes; one rounding of the add), acc += (s * d_b) * f, accm += m * sx_b as above.
// An input is off by at most 2^-31 of its block's largest magnitude (int8: 2^-8): below the fp32
// rounding of the products themselves, so these are the dequantised weights' fp32 products up
// to rounding (docs/kernels/cpu.md: quality), at about the int8 kernels' speed.
#pragma once

#include <cstdint>

#include "cpu_gemm_affine.h"
#include "cpu_gguf_pack.h"

namespace pyengine::cpu {

// Bytes of one 32-input block of one 16-column panel: 4-bit or 8-bit codes.
constexpr int64_t qdot_block_bytes(int bits) { return bits == 4 ? 320 : 544; }

// AVX2, FMA and F16C at run time.
bool has_qdot();
// And AVX-512 F / BW / VL / VNNI: the int16x2 kernels with one vpdpwssd per pair of products
// (cpu_gemm_qdot16_avx512.cpp), the same bits as the AVX2 ones.
bool has_qdot16_avx512();

// The int16x2 kernels a weight runs (cpu_gemm.h's GemmIsa values): AVX2; AVX-512 VNNI; AVX-512
// VNNI up to 3 rows and AMX-INT8 tile products for more (cpu_gemm_qdot16_amx.cpp). Same bits.
constexpr int kQdotAvx2 = 2, kQdotAvx512 = 3, kQdotAmx = 4;
// The best of those this CPU runs, at most `limit`.
int qdot16_isa(int limit);

// Packs GGUF rows (cpu_gguf_pack.h) into the layout above: bits 4 (Q4_0, Q4_1) or 8 (Q8_0).
// False (out unspecified) for another type, K not a multiple of 32, a non-finite d or m, or a
// Q4_0 block whose -8 d is not an fp16 value.
bool pack_gguf_qdot(const GgufRows& src, int64_t k, int64_t n, PanelStore& out);

// y [M, N] (row stride N) = x [M, K] (row stride x_row_stride) @ W + bias (null or [N]), with x
// quantised per 32-input block to act_bits 8 (int8) or 32 (two int16 limbs). isa: act_bits 32's
// kernels, one qdot16_isa() returned (the same bits on each).
void qdot_matmul(const uint8_t* packed, int bits, int64_t k, int64_t n, const float* x, int64_t x_row_stride,
                 int64_t m, const float* bias, float* y, int act_bits = 8, int isa = kQdotAvx2);

// Columns ids[0 .. count) of W as rows out[count][K] fp32: s * q (8-bit: Q8_0's d * q) or
// fma(s, q, m) (4-bit: exact, d * q has at most 15 significant bits). False for an id outside [0, N).
bool qdot_columns(const uint8_t* packed, int bits, int64_t k, int64_t n, const int64_t* ids, int64_t count,
                  float* out);

}  // namespace pyengine::cpu
