// The packed GEMM of cpu_gemm.h on CPUs without AVX-512: AVX2 + FMA (x86-64-v3) micro-kernels over
// the same panels (dense fp32, bf16 pairs, and the compact affine formats of cpu_gemm_affine.h).
//
// Batch invariance: every output row is one chain acc = fma(x[r][k], w[k][c], acc) over k in
// order, starting at +0, then + bias and one rounding to the output dtype. A row's chain is its own
// (own accumulators; x broadcast, no horizontal sums), so its bits depend on neither M, nor the
// row group or row chunk it lands in, nor the thread count: only the packing (K, N, dtype) fixes
// the order. bf16 weights and inputs widen to fp32 by a 16-bit shift, so their products are exact
// and the two k of a pair are two FMAs, k then k + 1. Compact affine weights are rebuilt per
// 32-input block with the fma(s, q, m) that pack_affine() verified, i.e. to the dense values, so
// compact and dense panels give the same bits here too.
//
// Which kernel runs a row group (6-row fp32, 4-row bf16 pairs, fused block rebuild, whole-panel
// rebuild) is chosen by the row count of the chunk, but every choice runs the same FMA chain per
// output, so the choice never shows in the bits (tests compare M = 1 .. 300 and 1 .. 3 threads).
//
// Results differ from the AVX-512 kernels (vdpbf16ps rounds differently; those accumulate in
// other registers): invariance holds within one machine's kernel family, which is what
// speculative decoding compares against.
#pragma once

#include <cstdint>

#include "cpu_gemm_affine.h"
#include "cpu_vec.h"

namespace pyengine::cpu {

// AVX2 and FMA at run time.
bool has_avx2_gemm();

// y [M, N] = x [M, K] (row stride x_row_stride) @ W + bias, W packed as `format` (dense: [panels][K][16]
// fp32; affine: cpu_gemm_affine.h's blocks, in AffineLayout(format, K, N, paired)).
void avx2_matmul_f32(const uint32_t* packed, PanelFormat format, bool paired, int64_t k, int64_t n, const float* x,
                     int64_t x_row_stride, int64_t m, const float* bias, float* y);

// bf16: W as [panels][K / 2][16] pairs (w[2k] low half, w[2k + 1] high half).
void avx2_matmul_bf16(const uint32_t* packed, int64_t k, int64_t n, const bf16* x, int64_t x_row_stride, int64_t m,
                      const bf16* bias, bf16* y);

}  // namespace pyengine::cpu
