// cpu_gemm_avx2.h: AVX2 + FMA micro-kernels of up to 6 (fp32) or 4 (bf16) rows x 16 columns (two ymm
// accumulators per row), row groups looped over row chunks that stay in L2, the pool's threads
// claiming contiguous panel ranges.
#include "cpu_gemm_avx2.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "common/common.h"
#include "cpu_thread_pool.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define PE_HAVE_AVX2_GEMM 1
#include "cpu_gemm_avx2_affine.h"
#endif

namespace pyengine::cpu {

#ifdef PE_HAVE_AVX2_GEMM
namespace {

using namespace avx2_affine;

constexpr int kPanel = kPanelCols;
// Rows per micro-kernel call: fp32 6 (12 accumulators + 2 weight vectors + a broadcast of the 16
// ymm registers), bf16 4 (8 accumulators + the 4 widened weight vectors of a k pair). A bf16 row
// chunk of more than 4 rows widens the panel once and runs the fp32 kernel instead, and an affine
// one of more than 6 rebuilds the whole panel: per output the same FMAs in the same order.
constexpr int kRowsF32 = 6;
constexpr int kRowsBf16 = 4;
constexpr int kPrefetchLines = 16;            // weight lines requested ahead (1 KiB), as the AVX-512 path
constexpr int64_t kChunkBytes = 192 << 10;    // x rows of one chunk: L2-resident while the panels pass
// Contiguous panel ranges per pool thread, claimed dynamically (cpu_thread_pool.h): a thread that
// is not scheduled leaves its ranges to the others. Each output is still computed by one kernel
// call, so the results do not depend on the split.
constexpr int kChunksPerThread = 4;

// The accumulators are named registers, not arrays: GCC 12 kept arrays of __m256 on the stack
// and stored every accumulator back on each k step (2x slower). PE_ROWS(X) applies X to rows
// 0 .. 5; rows >= R compile away.
#define PE_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5)

// Accumulates rows [0, R) of x (fp32, row stride xs) against kc k-steps of a [kc][16] fp32 panel
// into acc [R][16] (zeros first when init).
template <int R, bool kPrefetch>
PE_AVX2 void kernel_f32(const float* x, int64_t xs, const float* w, int64_t kc, float* acc, bool init) {
  static_assert(R >= 1 && R <= 6);
#define PE_DECL(i) __m256 lo##i = _mm256_setzero_ps(), hi##i = _mm256_setzero_ps();
#define PE_LOAD(i) \
  if constexpr (R > i) lo##i = _mm256_loadu_ps(acc + 16 * i), hi##i = _mm256_loadu_ps(acc + 16 * i + 8);
#define PE_FMA(i)                                                      \
  if constexpr (R > i) {                                               \
    const __m256 xb = _mm256_broadcast_ss(x + i * xs + k);             \
    lo##i = _mm256_fmadd_ps(xb, w0, lo##i);                            \
    hi##i = _mm256_fmadd_ps(xb, w1, hi##i);                            \
  }
#define PE_STORE(i) \
  if constexpr (R > i) _mm256_storeu_ps(acc + 16 * i, lo##i), _mm256_storeu_ps(acc + 16 * i + 8, hi##i);
  PE_ROWS(PE_DECL)
  if (!init) {
    PE_ROWS(PE_LOAD)
  }
  for (int64_t k = 0; k < kc; ++k) {
    if constexpr (kPrefetch) _mm_prefetch(reinterpret_cast<const char*>(w + (k + kPrefetchLines) * kPanel), _MM_HINT_T0);
    const __m256 w0 = _mm256_loadu_ps(w + k * kPanel), w1 = _mm256_loadu_ps(w + k * kPanel + 8);
    PE_ROWS(PE_FMA)
  }
  PE_ROWS(PE_STORE)
#undef PE_FMA
}

// bf16 pairs: per k pair, the even k (low halves shifted up) then the odd k (high halves kept);
// x already widened to fp32.
template <int R>
PE_AVX2 void kernel_bf16(const float* x, int64_t xs, const uint32_t* panel, int64_t k_pairs, float* acc) {
  static_assert(R >= 1 && R <= 4);
  PE_ROWS(PE_DECL)
  const __m256i high_half = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
#define PE_FMA(i)                                                      \
  if constexpr (R > i) {                                               \
    const __m256 xe = _mm256_broadcast_ss(x + i * xs + 2 * kp);        \
    lo##i = _mm256_fmadd_ps(xe, e0, lo##i);                            \
    hi##i = _mm256_fmadd_ps(xe, e1, hi##i);                            \
    const __m256 xo = _mm256_broadcast_ss(x + i * xs + 2 * kp + 1);    \
    lo##i = _mm256_fmadd_ps(xo, o0, lo##i);                            \
    hi##i = _mm256_fmadd_ps(xo, o1, hi##i);                            \
  }
  for (int64_t kp = 0; kp < k_pairs; ++kp) {
    _mm_prefetch(reinterpret_cast<const char*>(panel + (kp + kPrefetchLines) * kPanel), _MM_HINT_T0);
    const __m256i p0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + kp * kPanel));
    const __m256i p1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + kp * kPanel + 8));
    const __m256 e0 = _mm256_castsi256_ps(_mm256_slli_epi32(p0, 16));
    const __m256 e1 = _mm256_castsi256_ps(_mm256_slli_epi32(p1, 16));
    const __m256 o0 = _mm256_castsi256_ps(_mm256_and_si256(p0, high_half));
    const __m256 o1 = _mm256_castsi256_ps(_mm256_and_si256(p1, high_half));
    PE_ROWS(PE_FMA)
  }
  PE_ROWS(PE_STORE)
#undef PE_FMA
#undef PE_DECL
#undef PE_LOAD
#undef PE_STORE
}
#undef PE_ROWS

using F32Kernel = void (*)(const float*, int64_t, const float*, int64_t, float*, bool);
using Bf16Kernel = void (*)(const float*, int64_t, const uint32_t*, int64_t, float*);

template <bool kPrefetch, int... R>
constexpr std::array<F32Kernel, sizeof...(R)> make_f32(std::integer_sequence<int, R...>) {
  return {&kernel_f32<R + 1, kPrefetch>...};
}
template <int... R>
constexpr std::array<Bf16Kernel, sizeof...(R)> make_bf16(std::integer_sequence<int, R...>) {
  return {&kernel_bf16<R + 1>...};
}
const auto kF32Stream = make_f32<true>(std::make_integer_sequence<int, kRowsF32>{});   // dense panels
const auto kF32Block = make_f32<false>(std::make_integer_sequence<int, kRowsF32>{});   // an L1 block
const auto kBf16 = make_bf16(std::make_integer_sequence<int, kRowsBf16>{});

// y rows [0, rows) (stride ys, `cols` valid columns) = acc [rows][16] + bias, rounded to T.
PE_AVX2_INLINE __m128i to_bf16x8(__m256 v) {  // round to nearest even, NaN kept quiet (cpu_vec.h's from_float)
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7fff)), lsb), 16);
  const __m256i nan = _mm256_or_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(0x40));
  const __m256i is_nan = _mm256_cmpgt_epi32(_mm256_and_si256(bits, _mm256_set1_epi32(0x7fffffff)),
                                            _mm256_set1_epi32(0x7f800000));
  const __m256i r = _mm256_blendv_epi8(rounded, nan, is_nan);  // 8 x uint16 in the low halves
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

template <typename T>
PE_AVX2 void store_rows(const float* acc, int rows, const float* bias16, T* y, int64_t ys, int cols) {
  for (int r = 0; r < rows; ++r) {
    __m256 lo = _mm256_loadu_ps(acc + 16 * r), hi = _mm256_loadu_ps(acc + 16 * r + 8);
    if (bias16) lo = _mm256_add_ps(lo, _mm256_loadu_ps(bias16)), hi = _mm256_add_ps(hi, _mm256_loadu_ps(bias16 + 8));
    T out[kPanel];
    if constexpr (std::is_same_v<T, float>) {
      _mm256_storeu_ps(out, lo);
      _mm256_storeu_ps(out + 8, hi);
    } else {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out), to_bf16x8(lo));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 8), to_bf16x8(hi));
    }
    std::memcpy(y + r * ys, out, sizeof(T) * cols);
  }
}

// A panel's bias as 16 fp32 (padding columns 0), or null.
template <typename T>
const float* panel_bias(const T* bias, int64_t p, int cols, float (&dst)[kPanel]) {
  if (!bias) return nullptr;
  for (int c = 0; c < kPanel; ++c) dst[c] = c < cols ? to_float(bias[p * kPanel + c]) : 0.0f;
  return dst;
}

// n floats of `v` starting on a 64-byte line: a panel row is then one line (std::vector's 16-byte
// alignment split every other ymm load over two lines: 1.6x slower kernels).
float* aligned_buffer(std::vector<float>& v, int64_t n) {
  v.resize(static_cast<size_t>(n) + 16);
  const auto address = reinterpret_cast<uintptr_t>(v.data());
  return v.data() + ((64 - address % 64) % 64) / sizeof(float);
}

// Rows per chunk: a multiple of `group` whose x rows (k fp32 each) fit kChunkBytes.
int64_t chunk_rows(int64_t k, int group) {
  return std::max<int64_t>(group, kChunkBytes / (k * 4) / group * group);
}

// A bf16 pair panel [k_pairs][16] -> fp32 [2 k_pairs][16]: row 2kp the low halves, 2kp + 1 the
// high ones. The fp32 kernel over it runs, per output, the very FMAs of kernel_bf16 (k in order).
PE_AVX2 void widen_panel(const uint32_t* panel, int64_t k_pairs, float* w) {
  const __m256i high_half = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t kp = 0; kp < k_pairs; ++kp) {
    const __m256i p0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + kp * kPanel));
    const __m256i p1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + kp * kPanel + 8));
    float* even = w + 2 * kp * kPanel;
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(even), _mm256_slli_epi32(p0, 16));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(even + 8), _mm256_slli_epi32(p1, 16));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(even + kPanel), _mm256_and_si256(p0, high_half));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(even + kPanel + 8), _mm256_and_si256(p1, high_half));
  }
}

PE_AVX2 void widen_bf16(const bf16* x, int64_t xs, int64_t m, int64_t k, float* dst) {
  for (int64_t r = 0; r < m; ++r)
    for (int64_t c = 0; c < k; ++c) dst[r * k + c] = to_float(x[r * xs + c]);
}

}  // namespace

bool has_avx2_gemm() { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); }

void avx2_matmul_f32(const uint32_t* packed, PanelFormat format, bool paired, int64_t k, int64_t n, const float* x,
                     int64_t x_row_stride, int64_t m, const float* bias, float* y) {
  const int64_t panels = ceil_div(n, kPanel);
  const int64_t chunk = chunk_rows(k, kRowsF32);
  const int64_t blocks = k / kAffineRun;
  const AffineLayout lay(format, k, n, paired);
  // Threads claim ranges of whole pairs (a pair is one stream, run by one kernel call).
  const int64_t unit = lay.paired ? 2 : 1, units = ceil_div(panels, unit);
  ThreadPool& pool = shared_pool();
  const int64_t parts = std::min<int64_t>(units, kChunksPerThread * pool.num_threads());
  pool.run_chunks(parts, [&](int64_t c) {
    const int64_t begin = unit * split_begin(units, c, parts);
    const int64_t end = std::min(panels, unit * split_begin(units, c + 1, parts));
    if (begin >= end) return;
    thread_local std::vector<float> wpanel;  // affine, more rows than one group: [K][16] rebuilt
    alignas(64) float acc[kRowsF32 * kPanel];
    alignas(64) float wblock[kAffineRun * kPanel];
    float bias_buf[kPanel];
    for (int64_t r0 = 0; r0 < m; r0 += chunk) {
      const int64_t rows = std::min(chunk, m - r0);
      const float* xc = x + r0 * x_row_stride;
      float* yc = y + r0 * n;
      for (int64_t p = begin; p < end; ++p) {
        const int cols = static_cast<int>(std::min<int64_t>(kPanel, n - p * kPanel));
        const float* b = panel_bias(bias, p, cols, bias_buf);
        if (format == PanelFormat::kDense) {
          const float* panel = reinterpret_cast<const float*>(packed + p * k * kPanel);
          for (int64_t g = 0; g < rows; g += kRowsF32) {
            const int rg = static_cast<int>(std::min<int64_t>(kRowsF32, rows - g));
            kF32Stream[rg - 1](xc + g * x_row_stride, x_row_stride, panel, k, acc, true);
            store_rows(acc, rg, b, yc + g * n + p * kPanel, n, cols);
          }
          continue;
        }
        const uint8_t* block = reinterpret_cast<const uint8_t*>(packed + lay.block(p, 0));
        const int64_t step = lay.step(p) * 4;  // bytes from one block of panel p to its next
        if (rows == 1 && lay.width(p) == 2) {  // both panels of a pair at once (p is the first)
          alignas(64) float pair_acc[2 * kPanel];
          (format == PanelFormat::kAffine4 ? &kernel_affine_pair<4> : &kernel_affine_pair<8>)(xc, block, blocks, pair_acc);
          store_rows(pair_acc, 1, b, yc + p * kPanel, n, cols);
          ++p;
          const int cols1 = static_cast<int>(std::min<int64_t>(kPanel, n - p * kPanel));
          store_rows(pair_acc + kPanel, 1, panel_bias(bias, p, cols1, bias_buf), yc + p * kPanel, n, cols1);
          continue;
        }
        if (rows > kRowsF32) {  // the panel rebuilt once into L2, then every row group as dense
          float* wp = aligned_buffer(wpanel, k * kPanel);
          for (int64_t bk = 0; bk < blocks; ++bk, block += step)
            format == PanelFormat::kAffine4 ? decode_block<4>(block, wp + bk * kAffineRun * kPanel)
                                            : decode_block<8>(block, wp + bk * kAffineRun * kPanel);
          for (int64_t g = 0; g < rows; g += kRowsF32) {
            const int rg = static_cast<int>(std::min<int64_t>(kRowsF32, rows - g));
            kF32Block[rg - 1](xc + g * x_row_stride, x_row_stride, wp, k, acc, true);
            store_rows(acc, rg, b, yc + g * n + p * kPanel, n, cols);
          }
          continue;
        }
        if (rows <= 2) {  // weights rebuilt in registers (kernel_affine)
          using Fused = void (*)(const float*, int64_t, const uint8_t*, int64_t, int64_t, float*);
          static constexpr Fused kFused[2][2] = {{&kernel_affine<1, 4>, &kernel_affine<2, 4>},
                                                 {&kernel_affine<1, 8>, &kernel_affine<2, 8>}};
          kFused[format == PanelFormat::kAffine4 ? 0 : 1][rows - 1](xc, x_row_stride, block, blocks, step, acc);
          store_rows(acc, static_cast<int>(rows), b, yc + p * kPanel, n, cols);
          continue;
        }
        // One row group: each 32-input block rebuilt into L1 and consumed at once, the group's
        // sums carried in acc (stored and reloaded exactly, so the chain is the dense one).
        for (int64_t bk = 0; bk < blocks; ++bk, block += step) {
          format == PanelFormat::kAffine4 ? decode_block<4>(block, wblock) : decode_block<8>(block, wblock);
          kF32Block[rows - 1](xc + bk * kAffineRun, x_row_stride, wblock, kAffineRun, acc, bk == 0);
        }
        store_rows(acc, static_cast<int>(rows), b, yc + p * kPanel, n, cols);
      }
    }
  });
}

void avx2_matmul_bf16(const uint32_t* packed, int64_t k, int64_t n, const bf16* x, int64_t x_row_stride, int64_t m,
                      const bf16* bias, bf16* y) {
  const int64_t panels = ceil_div(n, kPanel), k_pairs = k / 2;
  thread_local std::vector<float> xf;  // x widened once, by the calling thread
  xf.resize(static_cast<size_t>(m * k));
  widen_bf16(x, x_row_stride, m, k, xf.data());
  const float* xw = xf.data();  // the workers read this thread's copy (a thread_local named in the
                                // lambda would be each worker's own)
  const int64_t chunk = chunk_rows(k, kRowsF32);
  ThreadPool& pool = shared_pool();
  const int64_t parts = std::min<int64_t>(panels, kChunksPerThread * pool.num_threads());
  pool.run_chunks(parts, [&](int64_t c) {
    const int64_t begin = split_begin(panels, c, parts), end = split_begin(panels, c + 1, parts);
    thread_local std::vector<float> wpanel;  // more rows than one group: [K][16] widened
    alignas(64) float acc[kRowsF32 * kPanel];
    float bias_buf[kPanel];
    for (int64_t r0 = 0; r0 < m && begin < end; r0 += chunk) {
      const int64_t rows = std::min(chunk, m - r0);
      for (int64_t p = begin; p < end; ++p) {
        const int cols = static_cast<int>(std::min<int64_t>(kPanel, n - p * kPanel));
        const float* b = panel_bias(bias, p, cols, bias_buf);
        const uint32_t* panel = packed + p * k_pairs * kPanel;
        if (rows > kRowsBf16) {  // the panel widened once (exactly), then the fp32 kernel's 6-row groups
          float* wp = aligned_buffer(wpanel, k * kPanel);
          widen_panel(panel, k_pairs, wp);
          for (int64_t g = 0; g < rows; g += kRowsF32) {
            const int rg = static_cast<int>(std::min<int64_t>(kRowsF32, rows - g));
            kF32Block[rg - 1](xw + (r0 + g) * k, k, wp, k, acc, true);
            store_rows(acc, rg, b, y + (r0 + g) * n + p * kPanel, n, cols);
          }
          continue;
        }
        for (int64_t g = 0; g < rows; g += kRowsBf16) {
          const int rg = static_cast<int>(std::min<int64_t>(kRowsBf16, rows - g));
          kBf16[rg - 1](xw + (r0 + g) * k, k, panel, k_pairs, acc);
          store_rows(acc, rg, b, y + (r0 + g) * n + p * kPanel, n, cols);
        }
      }
    }
  });
}

#else  // no x86-64 GCC/Clang: has_avx2_gemm() is false and nothing calls the rest

bool has_avx2_gemm() { return false; }
void avx2_matmul_f32(const uint32_t*, PanelFormat, bool, int64_t, int64_t, const float*, int64_t, int64_t,
                     const float*, float*) {}
void avx2_matmul_bf16(const uint32_t*, int64_t, int64_t, const bf16*, int64_t, int64_t, const bf16*, bf16*) {}

#endif  // PE_HAVE_AVX2_GEMM

}  // namespace pyengine::cpu
