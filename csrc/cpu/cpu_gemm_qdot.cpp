// cpu_gemm_qdot.h: the int8 activation quantiser and the AVX2 integer-dot kernels (up to 4 rows x
// one 16-column panel), and the driver of both activation widths (the int16 kernels:
// cpu_gemm_qdot16.cpp): row groups looped over row chunks that stay in L2, the pool's threads
// claiming contiguous panel ranges.
#include "cpu_gemm_qdot.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "common/common.h"
#include "cpu_thread_pool.h"

#include "cpu_gemm_qdot_amx.h"
#include "cpu_gemm_qdot_kernels.h"

namespace pyengine::cpu {

#ifdef PE_HAVE_QDOT
namespace {

using namespace qdot;
constexpr int64_t kChunkBytes = 192 << 10;    // quantised x rows of one chunk: L2-resident while panels pass
constexpr int kChunksPerThread = 4;           // panel ranges per pool thread, claimed dynamically
constexpr int64_t kQuantisePerJob = 1 << 16;  // inputs quantised by the caller alone below this

// One row: x [blocks * 32] -> q int8 [blocks * 32], d and sx [blocks] (cpu_gemm_qdot.h's rule).
PE_QDOT void quantise_row(const float* x, int64_t blocks, uint8_t* q, float* d, float* sx) {
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undoes the packs' lane interleave
  for (int64_t b = 0; b < blocks; ++b, x += kRun, q += kRun) {
    __m256 v[4];
    float amax;
    if (!load_block(x, v, &amax, q, kRun, d + b, sx + b)) continue;
    const float db = amax / 127.0f;
    const __m256 id = _mm256_set1_ps(127.0f / amax);
    __m256i c[4];
    for (int i = 0; i < 4; ++i)
      c[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    const __m256i sum = _mm256_add_epi32(_mm256_add_epi32(c[0], c[1]), _mm256_add_epi32(c[2], c[3]));
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_permutevar8x32_epi32(bytes, order));
    d[b] = db;
    sx[b] = db * static_cast<float>(hsum(sum));
  }
}

// 4 bytes of row r's codes for inputs 4g .. 4g + 3 of block b, in every 32-bit lane.
#define PE_XB(r) _mm256_set1_epi32(load_i32(x.q + r * x.qs + b * kRun + 4 * g))

// out [R][16] = rows [0, R) of x against a 4-bit panel of `blocks` blocks (acc + accm).
// Per group: the 32 code bytes hold 8 columns x 4 inputs twice (low / high nibbles); vpmaddubsw
// (unsigned codes x signed x) sums pairs into int16, 8 groups add up to |sum| <= 8 * 2 * 15 * 127
// = 30480 (no int16 overflow), and vpmaddwd with ones gives each column's block sum in int32.
template <int R, int Bits>
PE_QDOT void kernel_q4(const QRows& x, const uint8_t* blk, int64_t blocks, float* out) {
  static_assert(R >= 1 && R <= kMaxRows && Bits == 4);
  constexpr int64_t kBytes = qdot_block_bytes(4);
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  PE_R(PE_ACC_DECL)
  for (int64_t b = 0; b < blocks; ++b, blk += kBytes) {
    for (int line = 0; line < kBytes; line += 64) _mm_prefetch(reinterpret_cast<const char*>(blk + 8 * kBytes + line), _MM_HINT_T0);
#define PE_I16(r) __m256i h##r##0 = _mm256_setzero_si256(), h##r##1 = h##r##0;
    PE_R(PE_I16)
#undef PE_I16
    for (int g = 0; g < 8; ++g) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 + 32 * g));
      const __m256i c0 = _mm256_and_si256(v, low), c1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
#define PE_DOT(r)                                                                 \
  if constexpr (R > r) {                                                          \
    const __m256i xb = PE_XB(r);                                                  \
    h##r##0 = _mm256_add_epi16(h##r##0, _mm256_maddubs_epi16(c0, xb));           \
    h##r##1 = _mm256_add_epi16(h##r##1, _mm256_maddubs_epi16(c1, xb));           \
  }
      PE_R(PE_DOT)
#undef PE_DOT
    }
    const __m256 s0 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk)));
    const __m256 s1 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16)));
    const __m256 m0 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 32)));
    const __m256 m1 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 48)));
#define PE_WIDEN(r) \
  const __m256i i##r##0 = R > r ? _mm256_madd_epi16(h##r##0, ones) : h##r##0, i##r##1 = R > r ? _mm256_madd_epi16(h##r##1, ones) : h##r##1;
    PE_R(PE_WIDEN)
#undef PE_WIDEN
    PE_R(PE_SCALE)
  }
  PE_R(PE_OUT)
}

// out [R][16] = rows [0, R) of x against an 8-bit panel. Signed codes: vpmaddubsw takes |q| and
// x with q's sign (|pair| <= 2 * 128 * 127 = 32512), vpmaddwd with ones sums to int32 per group.
template <int R, int Bits>
PE_QDOT void kernel_q8(const QRows& x, const uint8_t* blk, int64_t blocks, float* out) {
  static_assert(R >= 1 && R <= kMaxRows && Bits == 8);
  constexpr int64_t kBytes = qdot_block_bytes(8);
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256 m0 = _mm256_setzero_ps(), m1 = m0;
  PE_R(PE_ACC_DECL)
  for (int64_t b = 0; b < blocks; ++b, blk += kBytes) {
    for (int line = 0; line < kBytes; line += 64) _mm_prefetch(reinterpret_cast<const char*>(blk + 6 * kBytes + line), _MM_HINT_T0);
#define PE_I32(r) __m256i i##r##0 = _mm256_setzero_si256(), i##r##1 = i##r##0;
    PE_R(PE_I32)
#undef PE_I32
    for (int g = 0; g < 8; ++g) {
      const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32 + 64 * g));
      const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 + 64 * g));
      const __m256i a0 = _mm256_abs_epi8(w0), a1 = _mm256_abs_epi8(w1);
#define PE_DOT(r)                                                                                               \
  if constexpr (R > r) {                                                                                        \
    const __m256i xb = PE_XB(r);                                                                                \
    i##r##0 = _mm256_add_epi32(i##r##0, _mm256_madd_epi16(_mm256_maddubs_epi16(a0, _mm256_sign_epi8(xb, w0)), ones)); \
    i##r##1 = _mm256_add_epi32(i##r##1, _mm256_madd_epi16(_mm256_maddubs_epi16(a1, _mm256_sign_epi8(xb, w1)), ones)); \
  }
      PE_R(PE_DOT)
#undef PE_DOT
    }
    const __m256 s0 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk)));
    const __m256 s1 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16)));
    PE_R(PE_SCALE)
  }
  (void)m0, (void)m1;
  PE_R(PE_OUT)
}
#undef PE_XB

constexpr Kernel kQ4[kMaxRows] = {&kernel_q4<1, 4>, &kernel_q4<2, 4>, &kernel_q4<3, 4>, &kernel_q4<4, 4>};
constexpr Kernel kQ8[kMaxRows] = {&kernel_q8<1, 8>, &kernel_q8<2, 8>, &kernel_q8<3, 8>, &kernel_q8<4, 8>};

// Panel p's bias (its `cols` valid columns, zeros after) in buf, or null without a bias.
const float* panel_bias(const float* bias, int64_t p, int cols, float* buf) {
  if (!bias) return nullptr;
  for (int col = 0; col < kPanel; ++col) buf[col] = col < cols ? bias[p * kPanel + col] : 0.0f;
  return buf;
}

// y rows (stride ys, `cols` valid columns) = acc [rows][16] + bias16 (or not).
PE_QDOT void store_rows(const float* acc, int rows, const float* bias16, float* y, int64_t ys, int cols) {
  for (int r = 0; r < rows; ++r) {
    __m256 lo = _mm256_loadu_ps(acc + 16 * r), hi = _mm256_loadu_ps(acc + 16 * r + 8);
    if (bias16) lo = _mm256_add_ps(lo, _mm256_loadu_ps(bias16)), hi = _mm256_add_ps(hi, _mm256_loadu_ps(bias16 + 8));
    if (cols == kPanel) {
      _mm256_storeu_ps(y + r * ys, lo), _mm256_storeu_ps(y + r * ys + 8, hi);
      continue;
    }
    alignas(32) float row[kPanel];
    _mm256_store_ps(row, lo), _mm256_store_ps(row + 8, hi);
    std::memcpy(y + r * ys, row, sizeof(float) * cols);
  }
}

// y = the quantised rows (int16 limbs) against every panel, kAmxMinRows or more: AMX tile products over
// row groups of up to kAmxGroup rows (the last one padded with zero rows), the same bits.
void amx_matmul(const uint8_t* packed, int bits, int64_t blocks, int64_t n, const uint8_t* q, const float* d, const float* sx, int64_t m,
                const float* bias, float* y) {
  const int64_t panels = ceil_div(n, kPanel), row_bytes = blocks * kRun * 4, block_bytes = qdot_block_bytes(bits);
  const int tile_rows = static_cast<int>(std::min<int64_t>(kAmxGroup, m));
  const int64_t groups = ceil_div(m, tile_rows), group_bytes = blocks * 4 * tile_rows * kRun;
  ThreadPool& pool = shared_pool();
  thread_local std::vector<uint8_t> abuf;  // amx_rows' layout, group after group
  abuf.resize(static_cast<size_t>(groups * group_bytes));
  uint8_t* xa = abuf.data();
  auto repack = [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t r0 = g * tile_rows;
      const QRows xr{q + r0 * row_bytes, row_bytes, d + r0 * blocks, sx + r0 * blocks, blocks};
      amx_rows(xr, static_cast<int>(std::min<int64_t>(tile_rows, m - r0)), tile_rows, blocks, xa + g * group_bytes);
    }
  };
  if (m * blocks * kRun < kQuantisePerJob) {
    repack(0, groups);
  } else {
    const int64_t parts = std::min<int64_t>(groups, kChunksPerThread * pool.num_threads());
    pool.run_chunks(parts, [&](int64_t c) { repack(split_begin(groups, c, parts), split_begin(groups, c + 1, parts)); });
  }
  const int64_t chunk = std::max<int64_t>(1, kChunkBytes / group_bytes);  // groups whose rows stay in L2
  const int64_t parts = std::min<int64_t>(panels, kChunksPerThread * pool.num_threads());
  pool.run_chunks(parts, [&](int64_t c) {
    const int64_t begin = split_begin(panels, c, parts), end = split_begin(panels, c + 1, parts);
    if (begin == end) return;
    alignas(64) float acc[kAmxGroup * kPanel];
    float bias_buf[kPanel];
    amx_begin(tile_rows);
    for (int64_t g0 = 0; g0 < groups; g0 += chunk) {
      for (int64_t p = begin; p < end; ++p) {
        const int cols = static_cast<int>(std::min<int64_t>(kPanel, n - p * kPanel));
        const float* b = panel_bias(bias, p, cols, bias_buf);
        const uint8_t* panel = packed + p * blocks * block_bytes;
        for (int64_t g = g0; g < std::min(groups, g0 + chunk); ++g) {
          const int64_t r0 = g * tile_rows;
          const int rows = static_cast<int>(std::min<int64_t>(tile_rows, m - r0));
          amx_panel(bits, rows, tile_rows, xa + g * group_bytes, d + r0 * blocks, sx + r0 * blocks, blocks, panel,
                    blocks, acc);
          store_rows(acc, rows, b, y + r0 * n + p * kPanel, n, cols);
        }
      }
    }
    amx_end();
  });
}

}  // namespace

bool has_qdot() {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

bool has_qdot16_avx512() {
  return has_qdot() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
}

int qdot16_isa(int limit) {
  if (limit >= kQdotAmx && has_qdot16_amx()) return kQdotAmx;
  if (limit >= kQdotAvx512 && has_qdot16_avx512()) return kQdotAvx512;
  return kQdotAvx2;
}

void qdot_matmul(const uint8_t* packed, int bits, int64_t k, int64_t n, const float* x, int64_t x_row_stride,
                 int64_t m, const float* bias, float* y, int act_bits, int isa) {
  const int64_t blocks = k / kRun, panels = ceil_div(n, kPanel), row_bytes = k * (act_bits / 8);
  const int64_t block_bytes = qdot_block_bytes(bits);
  ThreadPool& pool = shared_pool();
  // x quantised once, by the caller (a large M: row ranges over the pool); workers read this
  // thread's buffers (a thread_local named in the lambdas would be each worker's own).
  thread_local std::vector<uint8_t> qbuf;
  thread_local std::vector<float> dbuf;
  qbuf.resize(static_cast<size_t>(m * row_bytes));
  dbuf.resize(static_cast<size_t>(2 * m * blocks));
  uint8_t* q = qbuf.data();
  const Quantiser quantise_one = act_bits == 32 ? &quantise_row16x2 : &quantise_row;
  float *d = dbuf.data(), *sx = d + m * blocks;
  auto quantise = [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) quantise_one(x + r * x_row_stride, blocks, q + r * row_bytes, d + r * blocks, sx + r * blocks);
  };
  if (m * k < kQuantisePerJob) {
    quantise(0, m);
  } else {
    const int64_t parts = std::min<int64_t>(m, kChunksPerThread * pool.num_threads());
    pool.run_chunks(parts, [&](int64_t c) { quantise(split_begin(m, c, parts), split_begin(m, c + 1, parts)); });
  }
  if (act_bits == 32 && isa >= kQdotAmx && m >= kAmxMinRows) {
    amx_matmul(packed, bits, blocks, n, q, d, sx, m, bias, y);
    return;
  }
  const Kernel* kernels = act_bits == 32 ? (isa >= kQdotAvx512 ? qdot16x2_avx512_kernels(bits) : qdot16x2_kernels(bits))
                         : bits == 4      ? kQ4
                                          : kQ8;
  const int64_t chunk = std::max<int64_t>(kMaxRows, kChunkBytes / row_bytes / kMaxRows * kMaxRows);
  const int64_t parts = std::min<int64_t>(panels, kChunksPerThread * pool.num_threads());
  pool.run_chunks(parts, [&](int64_t c) {
    const int64_t begin = split_begin(panels, c, parts), end = split_begin(panels, c + 1, parts);
    alignas(64) float acc[kMaxRows * kPanel];
    float bias_buf[kPanel];
    for (int64_t r0 = 0; r0 < m && begin < end; r0 += chunk) {
      const int64_t rows = std::min(chunk, m - r0);
      for (int64_t p = begin; p < end; ++p) {
        const int cols = static_cast<int>(std::min<int64_t>(kPanel, n - p * kPanel));
        const float* b = panel_bias(bias, p, cols, bias_buf);
        const uint8_t* panel = packed + p * blocks * block_bytes;
        for (int64_t g = r0; g < r0 + rows; g += kMaxRows) {
          const int rg = static_cast<int>(std::min<int64_t>(kMaxRows, r0 + rows - g));
          const QRows xr{q + g * row_bytes, row_bytes, d + g * blocks, sx + g * blocks, blocks};
          kernels[rg - 1](xr, panel, blocks, acc);
          store_rows(acc, rg, b, y + g * n + p * kPanel, n, cols);
        }
      }
    }
  });
}

#else  // no x86-64 GCC/Clang: has_qdot() is false and nothing packs for the rest

bool has_qdot() { return false; }
bool has_qdot16_avx512() { return false; }
int qdot16_isa(int) { return kQdotAvx2; }
void qdot_matmul(const uint8_t*, int, int64_t, int64_t, const float*, int64_t, int64_t, const float*, float*, int,
                 int) {}

#endif  // PE_HAVE_QDOT

}  // namespace pyengine::cpu
