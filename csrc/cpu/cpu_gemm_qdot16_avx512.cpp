// cpu_gemm_qdot.h, int16x2 activations on AVX-512 VNNI: the kernels of cpu_gemm_qdot16.cpp (same
// panels, same quantised rows, same bits) with a panel's 16 columns in one zmm and each pair of
// int16 products summed into int32 by one vpdpwssd.
//
// Why: on the AVX2 kernels a row costs 8 vpmaddwd + 8 adds per 64 weights, so each verify row of a
// speculative step added ~0.5 of a decode step (docs/speculation.md, "Speculation on the CPU").
// Here a row costs 4 vpdpwssd per 64 weights, and up to 4 rows share one unpacking of the codes.
//
// The same bits as the AVX2 kernels, on purpose: the integer sums are exact (|sum| < 2^28, the
// same integers in any order; vpdpwssd wraps as vpmaddwd + vpaddd do and nothing overflows), and
// the float part of a block is the same operations per column in the same order, 16 lanes instead
// of 2 x 8. So a row's result still depends on the row alone, and on no CPU feature.
#include "cpu_gemm_qdot_kernels.h"

#ifdef PE_HAVE_QDOT
namespace pyengine::cpu::qdot {
namespace {

#define PE_QDOT512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))

// 4 bytes of row r's limb-l codes for inputs 4g .. 4g + 3 of block b (cpu_gemm_qdot16.cpp's order).
#define PE_XW(r, l, j) _mm512_set1_epi32(load_i32(x.q + r * x.qs + 64 * (2 * b + l) + 8 * g + 4 * j))
// kSplit (1-2 rows): each limb's sum in two chains, (x0, x2) and (x1, x3) products apart, added
// before the fold: exact integers, so the same sums; a 16-deep vpdpwssd chain per block bound one
// row's kernel by latency (3-4 rows have chains enough, and the extra registers spilled there).
#define PE_DOT(r)                                                                                            \
  if constexpr (R > r) {                                                                                     \
    if constexpr (kSplit) {                                                                                  \
      i##r = _mm512_dpwssd_epi32(i##r, c02, PE_XW(r, 0, 0));                                                 \
      i2##r = _mm512_dpwssd_epi32(i2##r, c13, PE_XW(r, 0, 1));                                               \
      j##r = _mm512_dpwssd_epi32(j##r, c02, PE_XW(r, 1, 0));                                                 \
      j2##r = _mm512_dpwssd_epi32(j2##r, c13, PE_XW(r, 1, 1));                                               \
    } else {                                                                                                 \
      i##r = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(i##r, c02, PE_XW(r, 0, 0)), c13, PE_XW(r, 0, 1));       \
      j##r = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(j##r, c02, PE_XW(r, 1, 0)), c13, PE_XW(r, 1, 1));       \
    }                                                                                                        \
  }
#define PE_ACC(r) __m512 acc##r = _mm512_setzero_ps(), accm##r = acc##r;
#define PE_I32(r) __m512i i##r = _mm512_setzero_si512(), j##r = i##r, i2##r = i##r, j2##r = i##r;
#define PE_SCALE512(r)                                                                                    \
  if constexpr (R > r) {                                                                                  \
    if constexpr (kSplit) i##r = _mm512_add_epi32(i##r, i2##r), j##r = _mm512_add_epi32(j##r, j2##r);     \
    fold_block512<Bits>(i##r, j##r, s, m, x.d[r * x.bs + b], x.sx[r * x.bs + b], acc##r, accm##r);        \
  }
#define PE_OUT512(r)                                                 \
  if constexpr (R > r) {                                          \
    if constexpr (Bits == 4) acc##r = _mm512_add_ps(acc##r, accm##r); \
    _mm512_storeu_ps(out + 16 * r, acc##r);                       \
  }

// out [R][16] = rows [0, R) of x (two int16 limbs) against a panel of `blocks` blocks. Lane c of
// c02 / c13 (int32) holds column c's codes of inputs (4g, 4g + 2) / (4g + 1, 4g + 3) as int16:
// 4-bit, the group's 32 bytes in both halves, nibbles 0 / 2 for columns 0-7 and 1 / 3 for 8-15
// (per-half shifts); 8-bit, columns 0-7 then 8-15 as stored, low / high bytes sign-extended.
template <int R, int Bits>
PE_QDOT512 void kernel16_avx512(const QRows& x, const uint8_t* blk, int64_t blocks, float* out) {
  static_assert(R >= 1 && R <= kMaxRows && (Bits == 4 || Bits == 8));
  constexpr int64_t kBytes = qdot_block_bytes(Bits);
  constexpr int kAhead = Bits == 4 ? 8 : 6;  // the AVX2 kernels' prefetch distances
  constexpr bool kSplit = R == 1;
  const __m512i low = _mm512_set1_epi16(0x0F);
  const __m512i shift02 = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
  const __m512i shift13 = _mm512_add_epi16(shift02, _mm512_set1_epi16(8));
  __m512 m = _mm512_setzero_ps();
  PE_R(PE_ACC)
  for (int64_t b = 0; b < blocks; ++b, blk += kBytes) {
    for (int line = 0; line < kBytes; line += 64) _mm_prefetch(reinterpret_cast<const char*>(blk + kAhead * kBytes + line), _MM_HINT_T0);
    PE_R(PE_I32)
    for (int g = 0; g < 8; ++g) {
      __m512i c02, c13;
      if constexpr (Bits == 4) {
        const __m512i v = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 + 32 * g)));
        c02 = _mm512_and_si512(_mm512_srlv_epi16(v, shift02), low);
        c13 = _mm512_and_si512(_mm512_srlv_epi16(v, shift13), low);
      } else {
        const __m512i w = _mm512_loadu_si512(blk + 32 + 64 * g);
        c02 = _mm512_srai_epi16(_mm512_slli_epi16(w, 8), 8), c13 = _mm512_srai_epi16(w, 8);
      }
      PE_R(PE_DOT)
    }
    const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk)));
    if constexpr (Bits == 4) m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32)));
    PE_R(PE_SCALE512)
  }
  (void)m, (void)low, (void)shift13;
  PE_R(PE_OUT512)
}
#undef PE_OUT512
#undef PE_SCALE512
#undef PE_I32
#undef PE_ACC
#undef PE_DOT
#undef PE_XW

constexpr Kernel kQ4[kMaxRows] = {&kernel16_avx512<1, 4>, &kernel16_avx512<2, 4>, &kernel16_avx512<3, 4>,
                                  &kernel16_avx512<4, 4>};
constexpr Kernel kQ8[kMaxRows] = {&kernel16_avx512<1, 8>, &kernel16_avx512<2, 8>, &kernel16_avx512<3, 8>,
                                  &kernel16_avx512<4, 8>};

}  // namespace

const Kernel* qdot16x2_avx512_kernels(int bits) { return bits == 4 ? kQ4 : kQ8; }

}  // namespace pyengine::cpu::qdot
#endif  // PE_HAVE_QDOT
