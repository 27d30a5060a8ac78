// The AVX2 + FMA kernels of cpu_gemm_avx2.cpp over the compact affine panels (cpu_gemm_affine.h):
// a 32-input block rebuilt as fp32 weights, one or two rows against a whole panel with the weights
// rebuilt in registers, and one row against a pair of panels. x86-64 GCC / Clang only (the includer
// checks); internal to cpu_gemm_avx2.cpp.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "cpu_gemm_affine.h"

#define PE_AVX2 __attribute__((target("avx2,fma")))
#define PE_AVX2_INLINE inline __attribute__((target("avx2,fma"), always_inline))

namespace pyengine::cpu::avx2_affine {

// 8 code bytes -> 8 int32 (4-bit: both nibbles still packed; 8-bit: signed).
template <int Bits>
PE_AVX2_INLINE __m256i line_codes(const uint8_t* q) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q));
  return Bits == 4 ? _mm256_cvtepu8_epi32(bytes) : _mm256_cvtepi8_epi32(bytes);
}

// Rebuilds one 32-input block of an affine panel as [32][16] fp32 (the weights pack_affine checked).
template <int Bits>
PE_AVX2 void decode_block(const uint8_t* block, float* w) {
  constexpr int64_t kBlockBytes = affine_block_words(Bits == 4 ? PanelFormat::kAffine4 : PanelFormat::kAffine8) * 4;
  for (int64_t line = 0; line < kBlockBytes; line += 64)  // four blocks ahead, as the AVX-512 kernels
    _mm_prefetch(reinterpret_cast<const char*>(block + 4 * kBlockBytes + line), _MM_HINT_T0);
  const float* sm = reinterpret_cast<const float*>(block);
  const __m256 s0 = _mm256_loadu_ps(sm), s1 = _mm256_loadu_ps(sm + 8);
  const __m256 m0 = _mm256_loadu_ps(sm + 16), m1 = _mm256_loadu_ps(sm + 24);
  const uint8_t* q = block + 128;
  if constexpr (Bits == 4) {
    const __m256i low_nibble = _mm256_set1_epi32(0xF);
    for (int j = 0; j < kAffineRun / 2; ++j) {
      const __m256i c0 = line_codes<Bits>(q + 16 * j), c1 = line_codes<Bits>(q + 16 * j + 8);
      float* w0 = w + (2 * j) * kPanelCols;
      float* w1 = w0 + kPanelCols;
      _mm256_storeu_ps(w0, _mm256_fmadd_ps(s0, _mm256_cvtepi32_ps(_mm256_and_si256(c0, low_nibble)), m0));
      _mm256_storeu_ps(w0 + 8, _mm256_fmadd_ps(s1, _mm256_cvtepi32_ps(_mm256_and_si256(c1, low_nibble)), m1));
      _mm256_storeu_ps(w1, _mm256_fmadd_ps(s0, _mm256_cvtepi32_ps(_mm256_srli_epi32(c0, 4)), m0));
      _mm256_storeu_ps(w1 + 8, _mm256_fmadd_ps(s1, _mm256_cvtepi32_ps(_mm256_srli_epi32(c1, 4)), m1));
    }
  } else {
    for (int j = 0; j < kAffineRun; ++j) {
      _mm256_storeu_ps(w + j * kPanelCols, _mm256_fmadd_ps(s0, _mm256_cvtepi32_ps(line_codes<Bits>(q + 16 * j)), m0));
      _mm256_storeu_ps(w + j * kPanelCols + 8, _mm256_fmadd_ps(s1, _mm256_cvtepi32_ps(line_codes<Bits>(q + 16 * j + 8)), m1));
    }
  }
}

// One or two rows of x against a whole affine panel (`blocks` 32-input blocks), each line of
// weights rebuilt in registers by decode_block's fma and used at once -> acc [R][16]. Per output
// the same weights and the same k-ordered FMA chain from +0 as decode_block + kernel_f32, minus
// their store and reload of every weight and sum: at batch 1 a step is bound by instructions more
// than by memory (~1 instruction a weight there, ~0.7 here).
// acc rows += x[r][k] * (w0 | w1): one k of one or two rows (kernel_affine).
template <int R>
PE_AVX2_INLINE void fma_rows(const float* xk, int64_t xs, __m256 w0, __m256 w1, __m256 (&acc)[4]) {
  const __m256 x0 = _mm256_broadcast_ss(xk);
  acc[0] = _mm256_fmadd_ps(x0, w0, acc[0]), acc[1] = _mm256_fmadd_ps(x0, w1, acc[1]);
  if constexpr (R == 2) {
    const __m256 x1 = _mm256_broadcast_ss(xk + xs);
    acc[2] = _mm256_fmadd_ps(x1, w0, acc[2]), acc[3] = _mm256_fmadd_ps(x1, w1, acc[3]);
  }
}

// `step`: bytes from one block of the panel to its next (AffineLayout::step).
template <int R, int Bits>
PE_AVX2 void kernel_affine(const float* x, int64_t xs, const uint8_t* block, int64_t blocks, int64_t step, float* acc) {
  static_assert(R == 1 || R == 2);
  constexpr int64_t kBlockBytes = affine_block_words(Bits == 4 ? PanelFormat::kAffine4 : PanelFormat::kAffine8) * 4;
  __m256 sums[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int64_t bk = 0; bk < blocks; ++bk, block += step) {
    for (int64_t line = 0; line < kBlockBytes; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(block + 4 * step + line), _MM_HINT_T0);
    const float* sm = reinterpret_cast<const float*>(block);
    const __m256 s0 = _mm256_loadu_ps(sm), s1 = _mm256_loadu_ps(sm + 8);
    const __m256 m0 = _mm256_loadu_ps(sm + 16), m1 = _mm256_loadu_ps(sm + 24);
    const uint8_t* q = block + 128;
    const float* xk = x + bk * kAffineRun;
    if constexpr (Bits == 4) {
      const __m256i low_nibble = _mm256_set1_epi32(0xF);
      for (int j = 0; j < kAffineRun / 2; ++j) {
        const __m256i c0 = line_codes<Bits>(q + 16 * j), c1 = line_codes<Bits>(q + 16 * j + 8);
        fma_rows<R>(xk + 2 * j, xs, _mm256_fmadd_ps(s0, _mm256_cvtepi32_ps(_mm256_and_si256(c0, low_nibble)), m0),
             _mm256_fmadd_ps(s1, _mm256_cvtepi32_ps(_mm256_and_si256(c1, low_nibble)), m1), sums);
        fma_rows<R>(xk + 2 * j + 1, xs, _mm256_fmadd_ps(s0, _mm256_cvtepi32_ps(_mm256_srli_epi32(c0, 4)), m0),
             _mm256_fmadd_ps(s1, _mm256_cvtepi32_ps(_mm256_srli_epi32(c1, 4)), m1), sums);
      }
    } else {
      for (int j = 0; j < kAffineRun; ++j)
        fma_rows<R>(xk + j, xs, _mm256_fmadd_ps(s0, _mm256_cvtepi32_ps(line_codes<Bits>(q + 16 * j)), m0),
                    _mm256_fmadd_ps(s1, _mm256_cvtepi32_ps(line_codes<Bits>(q + 16 * j + 8)), m1), sums);
    }
  }
  for (int i = 0; i < 2 * R; ++i) _mm256_storeu_ps(acc + 8 * i, sums[i]);
}

// One row of x against a pair of affine panels (AffineLayout's paired layout: block b of the
// first panel at block + b * 2 * kBlockBytes, the second's right after it) -> acc [2][16]. Why:
// one row's sums are 2 FMA chains per panel (lo, hi), each FMA waiting for the previous k's
// (4 cycles on Zen 3), so kernel_affine<1> ran at ~4 weights a cycle, bound by that latency and
// not by the 2 FMA units; two panels' 4 chains keep them busy (cache-resident SmolLM2 layers
// 9.3 -> 7.7 ms a step on one core; the 8-bit lm_head ~15% faster). Per output the FMAs and their
// order are kernel_affine<1>'s (same weights, k in order from +0): the same bits as a panel run
// alone.
template <int Bits>
PE_AVX2 void kernel_affine_pair(const float* x, const uint8_t* block, int64_t blocks, float* acc) {
  constexpr int64_t kBlockBytes = affine_block_words(Bits == 4 ? PanelFormat::kAffine4 : PanelFormat::kAffine8) * 4;
  constexpr int64_t kStep = 2 * kBlockBytes;
  constexpr int kAhead = 4;  // pair steps prefetched ahead (one stream; 2 to 16 timed alike)
  __m256 lo0 = _mm256_setzero_ps(), hi0 = _mm256_setzero_ps(), lo1 = _mm256_setzero_ps(), hi1 = _mm256_setzero_ps();
  const __m256i low_nibble = _mm256_set1_epi32(0xF);
  for (int64_t bk = 0; bk < blocks; ++bk, block += kStep) {
    for (int64_t line = 0; line < kStep; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(block + kAhead * kStep + line), _MM_HINT_T0);
    const float* xk = x + bk * kAffineRun;
    const float* sm0 = reinterpret_cast<const float*>(block);
    const float* sm1 = reinterpret_cast<const float*>(block + kBlockBytes);
    const __m256 s00 = _mm256_loadu_ps(sm0), s01 = _mm256_loadu_ps(sm0 + 8);
    const __m256 m00 = _mm256_loadu_ps(sm0 + 16), m01 = _mm256_loadu_ps(sm0 + 24);
    const __m256 s10 = _mm256_loadu_ps(sm1), s11 = _mm256_loadu_ps(sm1 + 8);
    const __m256 m10 = _mm256_loadu_ps(sm1 + 16), m11 = _mm256_loadu_ps(sm1 + 24);
    const uint8_t* q0 = block + 128;
    const uint8_t* q1 = block + kBlockBytes + 128;
    if constexpr (Bits == 4) {
      for (int j = 0; j < kAffineRun / 2; ++j) {  // line j: inputs 2j (low nibbles) and 2j + 1 (high)
        const __m256 xe = _mm256_broadcast_ss(xk + 2 * j), xo = _mm256_broadcast_ss(xk + 2 * j + 1);
        const __m256i a0 = line_codes<4>(q0 + 16 * j), a1 = line_codes<4>(q0 + 16 * j + 8);
        const __m256i b0 = line_codes<4>(q1 + 16 * j), b1 = line_codes<4>(q1 + 16 * j + 8);
        lo0 = _mm256_fmadd_ps(xe, _mm256_fmadd_ps(s00, _mm256_cvtepi32_ps(_mm256_and_si256(a0, low_nibble)), m00), lo0);
        hi0 = _mm256_fmadd_ps(xe, _mm256_fmadd_ps(s01, _mm256_cvtepi32_ps(_mm256_and_si256(a1, low_nibble)), m01), hi0);
        lo1 = _mm256_fmadd_ps(xe, _mm256_fmadd_ps(s10, _mm256_cvtepi32_ps(_mm256_and_si256(b0, low_nibble)), m10), lo1);
        hi1 = _mm256_fmadd_ps(xe, _mm256_fmadd_ps(s11, _mm256_cvtepi32_ps(_mm256_and_si256(b1, low_nibble)), m11), hi1);
        lo0 = _mm256_fmadd_ps(xo, _mm256_fmadd_ps(s00, _mm256_cvtepi32_ps(_mm256_srli_epi32(a0, 4)), m00), lo0);
        hi0 = _mm256_fmadd_ps(xo, _mm256_fmadd_ps(s01, _mm256_cvtepi32_ps(_mm256_srli_epi32(a1, 4)), m01), hi0);
        lo1 = _mm256_fmadd_ps(xo, _mm256_fmadd_ps(s10, _mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4)), m10), lo1);
        hi1 = _mm256_fmadd_ps(xo, _mm256_fmadd_ps(s11, _mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4)), m11), hi1);
      }
    } else {
      for (int j = 0; j < kAffineRun; ++j) {  // line j: input j, int8
        const __m256 xj = _mm256_broadcast_ss(xk + j);
        lo0 = _mm256_fmadd_ps(xj, _mm256_fmadd_ps(s00, _mm256_cvtepi32_ps(line_codes<8>(q0 + 16 * j)), m00), lo0);
        hi0 = _mm256_fmadd_ps(xj, _mm256_fmadd_ps(s01, _mm256_cvtepi32_ps(line_codes<8>(q0 + 16 * j + 8)), m01), hi0);
        lo1 = _mm256_fmadd_ps(xj, _mm256_fmadd_ps(s10, _mm256_cvtepi32_ps(line_codes<8>(q1 + 16 * j)), m10), lo1);
        hi1 = _mm256_fmadd_ps(xj, _mm256_fmadd_ps(s11, _mm256_cvtepi32_ps(line_codes<8>(q1 + 16 * j + 8)), m11), hi1);
      }
    }
  }
  _mm256_storeu_ps(acc, lo0), _mm256_storeu_ps(acc + 8, hi0);
  _mm256_storeu_ps(acc + 16, lo1), _mm256_storeu_ps(acc + 24, hi1);
}

}  // namespace pyengine::cpu::avx2_affine
