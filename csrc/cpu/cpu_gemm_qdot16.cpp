// cpu_gemm_qdot.h, int16x2 activations (act_bits 32): the quantiser and the AVX2 kernels (up to 2
// rows x one 16-column panel; 3-4 rows as two calls) over the same packed panels as the int8
// kernels; cpu_gemm_qdot.cpp drives both.
//
// Why: int8 activations (llama.cpp's arithmetic) move the default model's answers (the README's
// question answered with nonsense, top-1 agreement 97% with the exact products); one int16 limb
// (tried) still moved test_gguf's logits 0.0046 from HF's (tolerance 0.002 + 0.001 |ref|). Two
// limbs hold each input to 2^-31 of its block's largest magnitude, under fp32's own rounding,
// and vpmaddwd takes the widened codes at close to the int8 kernels' speed: a batch-1 step stays
// bound by streaming the weights (docs/kernels/cpu.md).
//
// x per block and limb is stored in the order (x0, x2, x1, x3) per 4 inputs: a 32-bit broadcast
// of (x0, x2) pairs, in vpmaddwd's int32 lane c, with the codes of inputs 4g and 4g + 2 of column
// c, which the panels' 16-bit lanes 2c and 2c + 1 hold in their low bytes (cpu_gemm_qdot.h's
// layout); (x1, x3) pairs with the high bytes. A block: limb 1's 32 int16, then limb 2's.
#include "cpu_gemm_qdot_kernels.h"

#ifdef PE_HAVE_QDOT
#include <cmath>
#include <limits>

namespace pyengine::cpu::qdot {
namespace {

constexpr float kLevels = 32767.0f;
constexpr float kLimb = 32768.0f;  // the second limb's scale: (p - q1) * 2^15, exact
constexpr int kRows = 2;           // rows per kernel: 2 x 4 int32 sums + 4 code vectors + 2 x 2 fp32 sums

// 4 bytes of row r's limb-l codes for inputs 4g .. 4g + 3 of block b: (x0, x2) at j = 0, (x1, x3) at 1.
#define PE_XW(r, l, j) _mm256_set1_epi32(load_i32(x.q + r * x.qs + 64 * (2 * b + l) + 8 * g + 4 * j))
// Row r's limb sums into its int32 accumulators: c02 / c13 columns 0-7, h02 / h13 columns 8-15.
// The empty asm keeps them in registers group after group: without it GCC 12 reassociates the
// unrolled groups' integer adds into a tree whose 32 partial products went to the stack (the
// two-limb 4-bit kernel ran at the speed of the fp32 one).
#define PE_LIMB(r, l, i0, i1)                                                                               \
  {                                                                                                         \
    const __m256i x02 = PE_XW(r, l, 0), x13 = PE_XW(r, l, 1);                                               \
    i0 = _mm256_add_epi32(i0, _mm256_add_epi32(_mm256_madd_epi16(c02, x02), _mm256_madd_epi16(c13, x13))); \
    i1 = _mm256_add_epi32(i1, _mm256_add_epi32(_mm256_madd_epi16(h02, x02), _mm256_madd_epi16(h13, x13))); \
    __asm__("" : "+x"(i0), "+x"(i1));                                                                       \
  }
#define PE_DOT(r)                                                       \
  if constexpr (R > r) PE_LIMB(r, 0, i##r##0, i##r##1) PE_LIMB(r, 1, j##r##0, j##r##1)
#define PE_I32(r) __m256i i##r##0 = _mm256_setzero_si256(), i##r##1 = i##r##0, j##r##0 = i##r##0, j##r##1 = i##r##0;
// Row r's block sum as floats f = float(i) + float(j) * 2^-15: one rounding (the product is exact).
#define PE_FOLD(r)                                                                                    \
  __m256 f##r##0 = lo_scale, f##r##1 = lo_scale;                                                      \
  if constexpr (R > r) {                                                                              \
    f##r##0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(j##r##0), lo_scale, _mm256_cvtepi32_ps(i##r##0));    \
    f##r##1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(j##r##1), lo_scale, _mm256_cvtepi32_ps(i##r##1));    \
  }
// cpu_gemm_qdot_kernels.h's PE_SCALE on the folded floats.
#define PE_SCALE16(r)                                                                           \
  if constexpr (R > r) {                                                                        \
    const __m256 db = _mm256_broadcast_ss(x.d + r * x.bs + b);                                 \
    acc##r##0 = _mm256_add_ps(acc##r##0, rounded(_mm256_mul_ps(_mm256_mul_ps(s0, db), f##r##0))); \
    acc##r##1 = _mm256_add_ps(acc##r##1, rounded(_mm256_mul_ps(_mm256_mul_ps(s1, db), f##r##1))); \
    if constexpr (Bits == 4) {                                                                  \
      const __m256 sxb = _mm256_broadcast_ss(x.sx + r * x.bs + b);                              \
      accm##r##0 = _mm256_add_ps(accm##r##0, rounded(_mm256_mul_ps(m0, sxb)));                   \
      accm##r##1 = _mm256_add_ps(accm##r##1, rounded(_mm256_mul_ps(m1, sxb)));                   \
    }                                                                                           \
  }

// out [R][16] = rows [0, R) of x (two int16 limbs) against a panel of `blocks` blocks.
// 4-bit: per group the 32 code bytes as 16-bit lanes: nibble 0 / 2 hold inputs 4g, 4g + 2 (lanes
// 2c, 2c + 1) of columns c / c + 8, nibble 1 / 3 inputs 4g + 1, 4g + 3, each masked out as an
// int16 code. 8-bit: columns 0-7 then 8-15, 32 bytes each, whose 16-bit lanes' low bytes (inputs
// 4g, 4g + 2) and high bytes (4g + 1, 4g + 3) are sign-extended by shifts.
template <int R, int Bits>
PE_QDOT void kernel16(const QRows& x, const uint8_t* blk, int64_t blocks, float* out) {
  static_assert(R >= 1 && R <= kRows && (Bits == 4 || Bits == 8));
  constexpr int64_t kBytes = qdot_block_bytes(Bits);
  constexpr int kAhead = Bits == 4 ? 8 : 6;  // blocks prefetched ahead (the int8 kernels' distances)
  const __m256i low = _mm256_set1_epi16(0x0F);
  const __m256 lo_scale = _mm256_set1_ps(1.0f / kLimb);
  __m256 m0 = _mm256_setzero_ps(), m1 = m0;
  PE_R(PE_ACC_DECL)
  for (int64_t b = 0; b < blocks; ++b, blk += kBytes) {
    for (int line = 0; line < kBytes; line += 64) _mm_prefetch(reinterpret_cast<const char*>(blk + kAhead * kBytes + line), _MM_HINT_T0);
    PE_R(PE_I32)
    for (int g = 0; g < 8; ++g) {
      __m256i c02, c13, h02, h13;
      if constexpr (Bits == 4) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 + 32 * g));
        c02 = _mm256_and_si256(v, low), c13 = _mm256_and_si256(_mm256_srli_epi16(v, 8), low);
        h02 = _mm256_and_si256(_mm256_srli_epi16(v, 4), low), h13 = _mm256_srli_epi16(v, 12);
      } else {
        const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32 + 64 * g));
        const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 + 64 * g));
        c02 = _mm256_srai_epi16(_mm256_slli_epi16(w0, 8), 8), c13 = _mm256_srai_epi16(w0, 8);
        h02 = _mm256_srai_epi16(_mm256_slli_epi16(w1, 8), 8), h13 = _mm256_srai_epi16(w1, 8);
      }
      PE_R(PE_DOT)
    }
    const __m256 s0 = load_half8(blk), s1 = load_half8(blk + 16);
    if constexpr (Bits == 4) m0 = load_half8(blk + 32), m1 = load_half8(blk + 48);
    PE_R(PE_FOLD)
    PE_R(PE_SCALE16)
  }
  (void)lo_scale, (void)low;
  PE_R(PE_OUT)
}
#undef PE_SCALE16
#undef PE_FOLD
#undef PE_I32
#undef PE_DOT
#undef PE_LIMB
#undef PE_XW

// 3 or 4 rows: two calls (more rows' sums would not stay in the 16 ymm registers); a row's
// arithmetic is the same in either.
template <int R, int Bits>
PE_QDOT void kernel16_split(const QRows& x, const uint8_t* blk, int64_t blocks, float* out) {
  kernel16<kRows, Bits>(x, blk, blocks, out);
  const QRows rest{x.q + kRows * x.qs, x.qs, x.d + kRows * x.bs, x.sx + kRows * x.bs, x.bs};
  kernel16<R - kRows, Bits>(rest, blk, blocks, out + kRows * kPanel);
}

constexpr Kernel kQ4[kMaxRows] = {&kernel16<1, 4>, &kernel16<2, 4>, &kernel16_split<3, 4>, &kernel16_split<4, 4>};
constexpr Kernel kQ8[kMaxRows] = {&kernel16<1, 8>, &kernel16<2, 8>, &kernel16_split<3, 8>, &kernel16_split<4, 8>};

// c[4], int32 codes of inputs 0-31 -> 64 bytes at out as int16 in (x0, x2, x1, x3) order; their sum.
PE_QDOT_INLINE int32_t store_codes(const __m256i* c, uint8_t* out) {
  // per 8 bytes (4 int16 codes, inputs 0 1 2 3) -> inputs 0 2 1 3
  const __m256i order = _mm256_setr_epi8(0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15,
                                         0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15);
  // packs interleaves 64-bit halves per 128-bit lane; 0xD8 puts inputs back in order
  const __m256i lo = _mm256_permute4x64_epi64(_mm256_packs_epi32(c[0], c[1]), 0xD8);
  const __m256i hi = _mm256_permute4x64_epi64(_mm256_packs_epi32(c[2], c[3]), 0xD8);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm256_shuffle_epi8(lo, order));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 32), _mm256_shuffle_epi8(hi, order));
  return hsum(_mm256_add_epi32(_mm256_add_epi32(c[0], c[1]), _mm256_add_epi32(c[2], c[3])));
}

}  // namespace

const Kernel* qdot16x2_kernels(int bits) { return bits == 4 ? kQ4 : kQ8; }

// cpu_gemm_qdot.h's rule: p = x * (32767 / a), q1 = rne(p), q2 = rne((p - q1) * 2^15), stored as
// int16 in (x0, x2, x1, x3) order per 4 inputs, limb 2 after limb 1; sx = d * (sum q1 + sum q2 * 2^-15).
PE_QDOT void quantise_row16x2(const float* x, int64_t blocks, uint8_t* q, float* d, float* sx) {
  const __m256 limb = _mm256_set1_ps(kLimb);
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  for (int64_t b = 0; b < blocks; ++b, x += kRun, q += 128) {
    __m256 v[4];
    float amax;
    if (!load_block(x, v, &amax, q, 128, d + b, sx + b)) continue;
    const float db = amax / kLevels;
    const __m256 id = _mm256_set1_ps(kLevels / amax);
    __m256i c[4], c2[4];
    for (int i = 0; i < 4; ++i) {
      const __m256 p = _mm256_mul_ps(v[i], id), r = _mm256_round_ps(p, kRound);
      c[i] = _mm256_cvtps_epi32(r);
      c2[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_sub_ps(p, r), limb), kRound));  // both exact
    }
    const float sum = std::fma(static_cast<float>(store_codes(c2, q + 64)), 1.0f / kLimb,
                               static_cast<float>(store_codes(c, q)));  // exact sums and product: one rounding
    d[b] = db;
    sx[b] = db * sum;
  }
}

}  // namespace pyengine::cpu::qdot

#endif  // PE_HAVE_QDOT
