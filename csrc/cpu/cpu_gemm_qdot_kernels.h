// Internal to cpu_gemm_qdot*.cpp: what the int8-activation kernels (cpu_gemm_qdot.cpp) and the
// int16x2-activation kernels (cpu_gemm_qdot16.cpp) share - the row view of quantised activations,
// the kernel signature, the float part of a block (the same for both) and small AVX2 helpers.
// Both read the same packed panels (cpu_gemm_qdot.h's layout).
#pragma once

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <limits>

#include "cpu_gemm_affine.h"
#include "cpu_gemm_qdot.h"

#define PE_HAVE_QDOT 1
#define PE_QDOT __attribute__((target("avx2,fma,f16c")))
#define PE_QDOT_INLINE inline __attribute__((target("avx2,fma,f16c"), always_inline))

namespace pyengine::cpu::qdot {

constexpr int kPanel = kPanelCols;
constexpr int kRun = kAffineRun;
constexpr int kMaxRows = 4;              // rows per kernel call
constexpr float kTinyBlock = 0x1p-100f;  // a block below this magnitude counts as zero

// Rows [0, R) of the quantised x against one panel: row r's codes at q + r * qs (bytes; int8 or
// int16 codes), its per-block d / sx at d + r * bs, sx + r * bs.
struct QRows {
  const uint8_t* q;
  int64_t qs;
  const float* d;
  const float* sx;
  int64_t bs;
};

// out [R][16] = rows [0, R) of x against a panel of `blocks` blocks.
using Kernel = void (*)(const QRows&, const uint8_t*, int64_t, float*);
// One row x [blocks * 32] -> codes (bytes), d and sx [blocks].
using Quantiser = void (*)(const float*, int64_t, uint8_t*, float*, float*);

// v, materialised: the product it holds is rounded before the add that takes it (GCC contracts
// _mm256_mul_ps + _mm256_add_ps into an FMA under -ffp-contract=fast, GNU C++'s default).
PE_QDOT_INLINE __m256 rounded(__m256 v) {
  __asm__("" : "+x"(v));
  return v;
}

PE_QDOT_INLINE float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

// One 32-input block of a row into v, for the quantisers: false when the block was settled here
// (a non-finite input: codes 0, d = sx = NaN; below kTinyBlock: codes 0, d = sx = 0), else true
// with amax = max |x|. q_bytes: the block's code bytes.
PE_QDOT_INLINE bool load_block(const float* x, __m256 v[4], float* amax, uint8_t* q, int64_t q_bytes, float* d,
                               float* sx) {
  const __m256 sign = _mm256_set1_ps(-0.0f), inf = _mm256_set1_ps(std::numeric_limits<float>::infinity());
  __m256 a[4];
  int finite = 0xFF;
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    a[i] = _mm256_andnot_ps(sign, v[i]);
    finite &= _mm256_movemask_ps(_mm256_cmp_ps(a[i], inf, _CMP_LT_OQ));
  }
  *amax = hmax(_mm256_max_ps(_mm256_max_ps(a[0], a[1]), _mm256_max_ps(a[2], a[3])));
  if (finite == 0xFF && *amax >= kTinyBlock) return true;
  std::memset(q, 0, q_bytes);
  *d = *sx = finite != 0xFF ? std::numeric_limits<float>::quiet_NaN() : 0.0f;
  return false;
}

PE_QDOT_INLINE int32_t hsum(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

PE_QDOT_INLINE int32_t load_i32(const void* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

PE_QDOT_INLINE __m256 load_half8(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// PE_R(X) applies X to rows 0 .. 3; rows >= R compile away. Accumulators are named registers
// (an array of __m256 was kept on the stack by GCC 12: cpu_gemm_avx2.cpp).
#define PE_R(X) X(0) X(1) X(2) X(3)
#define PE_ACC_DECL(r) __m256 acc##r##0 = _mm256_setzero_ps(), acc##r##1 = acc##r##0, accm##r##0 = acc##r##0, accm##r##1 = acc##r##0;
// Block b's integer sums of row r (i0: columns 0-7, i1: 8-15) into its fp32 accumulators:
// acc += (s * d) * isum, accm += m * sx, each product rounded before its add.
#define PE_SCALE(r)                                                                            \
  if constexpr (R > r) {                                                                       \
    const __m256 db = _mm256_broadcast_ss(x.d + r * x.bs + b);                                \
    acc##r##0 = _mm256_add_ps(acc##r##0, rounded(_mm256_mul_ps(_mm256_mul_ps(s0, db), _mm256_cvtepi32_ps(i##r##0)))); \
    acc##r##1 = _mm256_add_ps(acc##r##1, rounded(_mm256_mul_ps(_mm256_mul_ps(s1, db), _mm256_cvtepi32_ps(i##r##1)))); \
    if constexpr (Bits == 4) {                                                                 \
      const __m256 sxb = _mm256_broadcast_ss(x.sx + r * x.bs + b);                             \
      accm##r##0 = _mm256_add_ps(accm##r##0, rounded(_mm256_mul_ps(m0, sxb)));                  \
      accm##r##1 = _mm256_add_ps(accm##r##1, rounded(_mm256_mul_ps(m1, sxb)));                  \
    }                                                                                          \
  }
#define PE_OUT(r)                                                                              \
  if constexpr (R > r) {                                                                       \
    if constexpr (Bits == 4) acc##r##0 = _mm256_add_ps(acc##r##0, accm##r##0), acc##r##1 = _mm256_add_ps(acc##r##1, accm##r##1); \
    _mm256_storeu_ps(out + 16 * r, acc##r##0), _mm256_storeu_ps(out + 16 * r + 8, acc##r##1); \
  }

// ---- What the AVX-512 VNNI and AMX int16x2 kernels share (cpu_gemm_qdot16_avx512.cpp, _amx.cpp) ----
#define PE_QDOT512_INLINE inline __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c"), always_inline))

// v, materialised: its product is rounded before the add that takes it (no contraction to FMA).
PE_QDOT512_INLINE __m512 rounded512(__m512 v) {
  __asm__("" : "+v"(v));
  return v;
}

// One row's block sums of a panel's 16 columns (i: limb 1, j: limb 2) into its accumulators:
// f = float(i) + float(j) * 2^-15 (one rounding), acc += (s * d) * f and, 4-bit, accm += m * sx,
// each product rounded before its add - cpu_gemm_qdot16.cpp's PE_FOLD and PE_SCALE16, per lane.
template <int Bits>
PE_QDOT512_INLINE void fold_block512(__m512i i, __m512i j, __m512 s, __m512 m, float d, float sx, __m512& acc,
                                     __m512& accm) {
  const __m512 f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(j), _mm512_set1_ps(1.0f / 32768.0f), _mm512_cvtepi32_ps(i));
  acc = _mm512_add_ps(acc, rounded512(_mm512_mul_ps(_mm512_mul_ps(s, _mm512_set1_ps(d)), f)));
  if constexpr (Bits == 4) accm = _mm512_add_ps(accm, rounded512(_mm512_mul_ps(m, _mm512_set1_ps(sx))));
}

// The int16x2-activation kernels (kernels[R - 1] for `bits`) and quantiser: cpu_gemm_qdot16.cpp.
const Kernel* qdot16x2_kernels(int bits);
void quantise_row16x2(const float* x, int64_t blocks, uint8_t* q, float* d, float* sx);
// The same on AVX-512 VNNI, the same bits (has_qdot16_avx512()): cpu_gemm_qdot16_avx512.cpp.
const Kernel* qdot16x2_avx512_kernels(int bits);

}  // namespace pyengine::cpu::qdot

#endif  // x86-64 GCC/Clang
