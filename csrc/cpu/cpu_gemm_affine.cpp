// cpu_gemm_affine.h: finding each run's (s, m, q), packing, and the AVX-512 micro-kernels that
// rebuild the fp32 weights in registers (the AVX2 ones are in cpu_gemm_avx2.cpp).
#include "cpu_gemm_affine.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>

#include "common/common.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define PE_HAVE_AFFINE 1
#endif

namespace pyengine::cpu {
namespace {

uint32_t bits_of(float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof(u));
  return u;
}

// What the kernel computes for one weight: the same single-rounding fused multiply-add.
float rebuild(float s, int q, float m) { return std::fma(s, static_cast<float>(q), m); }

struct Run {
  float s = 0.0f, m = 0.0f;
  int8_t q[kAffineRun] = {};
};

// Whether scale s and offset m give every value of the run back exactly, with q in [q_lo, q_hi].
// Exactly means equal as numbers: a -0 weight (Q4_0's d * 0 for d < 0) comes back +0, which no
// product can tell apart in a sum that starts at +0, so the GEMM's outputs keep every bit.
bool fits(const float* w, int64_t stride, float s, float m, int q_lo, int q_hi, Run& run) {
  if (!std::isfinite(s)) return false;
  for (int i = 0; i < kAffineRun; ++i) {
    const float v = w[i * stride];
    const double qd = s == 0.0f ? 0.0 : std::nearbyint((static_cast<double>(v) - m) / s);
    if (!(qd >= q_lo && qd <= q_hi)) return false;
    const int q = static_cast<int>(qd);
    if (rebuild(s, q, m) != v) return false;
    run.q[i] = static_cast<int8_t>(q);
  }
  run.s = s, run.m = m;
  return true;
}

// Scale candidates for a run whose values span `range` in `steps` quantisation steps: the
// quotient in fp32, and rounded to fp16 with its neighbours (GGUF stores scales as fp16, and the
// largest value's own rounding can move the quotient off the stored scale).
template <typename Try>
bool try_scales(double range, int steps, Try&& attempt) {
  const float c = static_cast<float>(range / steps);
  if (attempt(c)) return true;
#if defined(__FLT16_MAX__)
  uint16_t h;  // c > 0: the fp16 neighbours are one code below and above
  const _Float16 rounded = static_cast<_Float16>(c);
  std::memcpy(&h, &rounded, sizeof(h));
  for (const uint16_t code : {h, static_cast<uint16_t>(h - 1), static_cast<uint16_t>(h + 1)}) {
    _Float16 v;
    std::memcpy(&v, &code, sizeof(v));
    const float s = static_cast<float>(v);
    if (s != c && s > 0.0f && attempt(s)) return true;
  }
#endif
  return false;
}

// 4-bit: the run's minimum is m (q = 0); its maximum is q = steps for some steps <= 15 (15 for
// Q4_1, the largest code used for Q4_0).
bool find_run4(const float* w, int64_t stride, Run& run) {
  float lo = w[0], hi = w[0];
  for (int i = 1; i < kAffineRun; ++i) lo = std::min(lo, w[i * stride]), hi = std::max(hi, w[i * stride]);
  if (!std::isfinite(lo) || !std::isfinite(hi)) return false;
  if (lo == hi) return fits(w, stride, 0.0f, lo, 0, 0, run);
  for (int steps = 15; steps >= 1; --steps)
    if (try_scales(static_cast<double>(hi) - lo, steps, [&](float s) { return fits(w, stride, s, lo, 0, 15, run); }))
      return true;
  return false;
}

// 8-bit symmetric (Q8_0): m = 0, the largest magnitude is q = +-127.
bool find_run8(const float* w, int64_t stride, Run& run) {
  float amax = 0.0f;
  for (int i = 0; i < kAffineRun; ++i) amax = std::max(amax, std::fabs(w[i * stride]));
  if (!std::isfinite(amax)) return false;
  if (amax == 0.0f) return fits(w, stride, 0.0f, 0.0f, 0, 0, run);
  return try_scales(amax, 127, [&](float s) { return fits(w, stride, s, 0.0f, -128, 127, run); });
}

#ifdef PE_HAVE_AFFINE
template <int R, int Bits>
__attribute__((target("avx512f,avx512bw"))) void micro_kernel_affine(const float* x, int64_t /*x_row_stride*/,
                                                                     const uint32_t* panel, int64_t k,
                                                                     const float* bias, float* y,
                                                                     int64_t y_row_stride, int cols) {
  constexpr int64_t kBlockBytes = affine_block_words(Bits == 4 ? PanelFormat::kAffine4 : PanelFormat::kAffine8) * 4;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const uint8_t* block = reinterpret_cast<const uint8_t*>(panel);
  for (int64_t k0 = 0; k0 < k; k0 += kAffineRun, block += kBlockBytes) {
    for (int64_t line = 0; line < kBlockBytes; line += 64)  // four blocks ahead: DRAM latency at this pace
      _mm_prefetch(reinterpret_cast<const char*>(block + 4 * kBlockBytes + line), _MM_HINT_T0);
    const __m512 s = _mm512_loadu_ps(block), m = _mm512_loadu_ps(block + 64);
    const uint8_t* q = block + 128;
    const float* xk = x + k0 * R;  // interleaved: xk[k * R + r]
    if constexpr (Bits == 4) {
      const __m512i low_nibble = _mm512_set1_epi32(0xF);
      for (int j = 0; j < kAffineRun / 2; ++j) {
        const __m512i codes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * j)));
        const __m512 w0 = _mm512_fmadd_ps(s, _mm512_cvtepi32_ps(_mm512_and_si512(codes, low_nibble)), m);
        const __m512 w1 = _mm512_fmadd_ps(s, _mm512_cvtepi32_ps(_mm512_srli_epi32(codes, 4)), m);
        for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(xk[(2 * j) * R + r]), w0, acc[r]);
        for (int r = 0; r < R; ++r)
          acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(xk[(2 * j + 1) * R + r]), w1, acc[r]);
      }
    } else {
      for (int j = 0; j < kAffineRun; ++j) {
        const __m512i codes = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * j)));
        const __m512 wj = _mm512_fmadd_ps(s, _mm512_cvtepi32_ps(codes), m);
        for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(xk[j * R + r]), wj, acc[r]);
      }
    }
  }
  const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1u);
  const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias) : _mm512_setzero_ps();
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + r * y_row_stride, mask, _mm512_add_ps(acc[r], b));
}

// 16 rows x 16 columns -> dst[c * 16 + r]: unpack pairs of rows, shuffle within 128-bit lanes,
// then two rounds of 128-bit lane shuffles.
__attribute__((target("avx512f"))) void transpose16(const __m512 (&rows)[16], float* dst) {
  __m512 t[16], r[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(rows[2 * i], rows[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(rows[2 * i], rows[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // r[4i + j], 128-bit lane L: column 4L + j of rows 4i .. 4i + 3
    r[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int j = 0; j < 4; ++j) {
    t[j] = _mm512_shuffle_f32x4(r[j], r[4 + j], 0x88);
    t[4 + j] = _mm512_shuffle_f32x4(r[j], r[4 + j], 0xDD);
    t[8 + j] = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0x88);
    t[12 + j] = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0xDD);
  }
  for (int j = 0; j < 4; ++j) {
    _mm512_storeu_ps(dst + 16 * j, _mm512_shuffle_f32x4(t[j], t[8 + j], 0x88));
    _mm512_storeu_ps(dst + 16 * (8 + j), _mm512_shuffle_f32x4(t[j], t[8 + j], 0xDD));
    _mm512_storeu_ps(dst + 16 * (4 + j), _mm512_shuffle_f32x4(t[4 + j], t[12 + j], 0x88));
    _mm512_storeu_ps(dst + 16 * (12 + j), _mm512_shuffle_f32x4(t[4 + j], t[12 + j], 0xDD));
  }
}

template <int Bits, int... R>
constexpr F32MicroKernels make_kernels(std::integer_sequence<int, R...>) {
  return F32MicroKernels{&micro_kernel_affine<R + 1, Bits>...};
}
#endif  // PE_HAVE_AFFINE

}  // namespace

AffineLayout::AffineLayout(PanelFormat f, int64_t k, int64_t n, bool pair)
    : panels(ceil_div(n, kPanelCols)),
      blocks(k / kAffineRun),
      words(f == PanelFormat::kDense ? 0 : affine_block_words(f)),
      paired(pair && f != PanelFormat::kDense) {}

bool pack_affine(const float* w, int64_t k, int64_t n, PanelFormat f, PanelStore& out, bool pair) {
#ifdef PE_HAVE_AFFINE
  if (k % kAffineRun != 0 || f == PanelFormat::kDense) return false;
  const AffineLayout lay(f, k, n, pair);
  const int64_t panels = lay.panels, blocks = lay.blocks, words = lay.words;
  out.assign(static_cast<size_t>(panels * blocks * words), 0u);  // padding columns: s = m = q = 0
  Run run;
  for (int64_t p = 0; p < panels; ++p)
    for (int64_t b = 0; b < blocks; ++b) {
      uint32_t* block = out.data() + lay.block(p, b);
      uint8_t* q = reinterpret_cast<uint8_t*>(block + 32);
      for (int c = 0; c < kPanelCols && p * kPanelCols + c < n; ++c) {
        const float* col = w + b * kAffineRun * n + p * kPanelCols + c;
        if (!(f == PanelFormat::kAffine4 ? find_run4(col, n, run) : find_run8(col, n, run))) return false;
        block[c] = bits_of(run.s);
        block[kPanelCols + c] = bits_of(run.m);
        for (int i = 0; i < kAffineRun; ++i) {
          if (f == PanelFormat::kAffine8)
            q[i * kPanelCols + c] = static_cast<uint8_t>(run.q[i]);
          else
            q[(i / 2) * kPanelCols + c] |= static_cast<uint8_t>(run.q[i] << (4 * (i % 2)));
        }
      }
    }
  return true;
#else
  (void)w, (void)k, (void)n, (void)f, (void)out, (void)pair;
  return false;
#endif
}

#ifdef PE_HAVE_AFFINE
namespace {
__attribute__((target("avx512f"))) void interleave_rows_avx512(const float* x, int64_t x_row_stride, int64_t m,
                                                               int64_t k, float* dst) {
  int64_t r0 = 0;
  for (; r0 + kGemmRows <= m; r0 += kGemmRows, dst += k * kGemmRows)
    for (int64_t c0 = 0; c0 < k; c0 += kGemmRows) {
      __m512 rows[kGemmRows];
      for (int r = 0; r < kGemmRows; ++r) rows[r] = _mm512_loadu_ps(x + (r0 + r) * x_row_stride + c0);
      transpose16(rows, dst + c0 * kGemmRows);
    }
  const int64_t rest = m - r0;  // a last tile of fewer rows: [K][rest]
  for (int64_t r = 0; r < rest; ++r)
    for (int64_t c = 0; c < k; ++c) dst[c * rest + r] = x[(r0 + r) * x_row_stride + c];
}
}  // namespace
#endif

void interleave_rows(const float* x, int64_t x_row_stride, int64_t m, int64_t k, float* dst) {
  PE_ASSERT(k % kGemmRows == 0);
#ifdef PE_HAVE_AFFINE
  interleave_rows_avx512(x, x_row_stride, m, k, dst);
#else
  (void)x, (void)x_row_stride, (void)m, (void)dst;
#endif
}

const F32MicroKernels& affine_kernels(PanelFormat f) {
#ifdef PE_HAVE_AFFINE
  static const F32MicroKernels k4 = make_kernels<4>(std::make_integer_sequence<int, kGemmRows>{});
  static const F32MicroKernels k8 = make_kernels<8>(std::make_integer_sequence<int, kGemmRows>{});
  PE_ASSERT(f != PanelFormat::kDense);
  return f == PanelFormat::kAffine4 ? k4 : k8;
#else
  static const F32MicroKernels none{};
  (void)f;
  return none;
#endif
}

}  // namespace pyengine::cpu
