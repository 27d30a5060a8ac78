// The bf16 decode GEMM of cpu_gemm.h: an AVX-512 BF16 micro-kernel of up to 16 rows x 16 columns
// (16 zmm accumulators, the weights streamed once, x broadcast from L1), threads splitting the
// panels into contiguous ranges.
#include "cpu_gemm.h"

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <memory>
#include <mutex>
#include <utility>

#include "common.h"
#include "cpu_thread_pool.h"

namespace pyengine::cpu {
namespace {

constexpr int kPanel = 16;  // columns per panel (one zmm of fp32 accumulators)
constexpr int kRows = 16;   // rows per micro-kernel call (16 accumulators)
constexpr int kPrefetchLines = 16;  // weight lines requested ahead (1 KiB): crosses 4 KiB pages

#define PE_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

template <int R>
PE_BF16_TARGET void micro_kernel(const bf16* x, int64_t x_row_stride, const uint32_t* panel, int64_t k_pairs,
                                 const bf16* bias, bf16* y, int64_t y_row_stride, int cols) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < k_pairs; ++kp) {
    _mm_prefetch(reinterpret_cast<const char*>(panel + (kp + kPrefetchLines) * kPanel), _MM_HINT_T0);
    const __m512bh w = (__m512bh)_mm512_loadu_si512(panel + kp * kPanel);
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * x_row_stride + 2 * kp, sizeof(pair));
      acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32(pair), w);
    }
  }
  __m512 b = _mm512_setzero_ps();
  const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1u);
  if (bias) b = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, bias)), 16));
  for (int r = 0; r < R; ++r) {
    const __m256bh out = _mm512_cvtneps_pbh(_mm512_add_ps(acc[r], b));
    _mm256_mask_storeu_epi16(y + r * y_row_stride, mask, (__m256i)out);
  }
}

using MicroKernel = void (*)(const bf16*, int64_t, const uint32_t*, int64_t, const bf16*, bf16*, int64_t, int);

template <int... R>
constexpr auto make_kernels(std::integer_sequence<int, R...>) {
  return std::array<MicroKernel, sizeof...(R)>{&micro_kernel<R + 1>...};
}
const auto kKernels = make_kernels(std::make_integer_sequence<int, kRows>{});

}  // namespace

bool has_bf16_gemm() {
#if defined(__x86_64__) && defined(__GNUC__)
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

PackedBf16Weight::PackedBf16Weight(const bf16* w, int64_t k, int64_t n)
    : k_(k), n_(n), k_pairs_(k / 2), panels_(ceil_div(n, kPanel)) {
  PE_CHECK(k > 0 && k % 2 == 0 && n > 0, "packed bf16 weight needs an even K and N > 0, got ", k, " x ", n);
  packed_.assign(static_cast<size_t>(panels_ * k_pairs_ * kPanel), 0u);
  for (int64_t p = 0; p < panels_; ++p)
    for (int64_t kp = 0; kp < k_pairs_; ++kp)
      for (int c = 0; c < kPanel && p * kPanel + c < n; ++c) {
        const int64_t col = p * kPanel + c;
        const uint32_t lo = w[(2 * kp) * n + col], hi = w[(2 * kp + 1) * n + col];
        packed_[(p * k_pairs_ + kp) * kPanel + c] = lo | (hi << 16);
      }
}

void PackedBf16Weight::matmul(const bf16* x, int64_t x_row_stride, int64_t m, const bf16* bias, bf16* y) const {
  PE_CHECK(has_bf16_gemm(), "this CPU lacks avx512_bf16");
  if (m <= 0) return;
  const uint32_t* packed = packed_.data();
  auto run = [&](int t, int nt) {
    const int64_t begin = split_begin(panels_, t, nt), end = split_begin(panels_, t + 1, nt);
    for (int64_t p = begin; p < end; ++p) {
      const int cols = static_cast<int>(std::min<int64_t>(kPanel, n_ - p * kPanel));
      const uint32_t* panel = packed + p * k_pairs_ * kPanel;
      for (int64_t r0 = 0; r0 < m; r0 += kRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kRows, m - r0));
        kKernels[rows - 1](x + r0 * x_row_stride, x_row_stride, panel, k_pairs_, bias ? bias + p * kPanel : nullptr,
                           y + r0 * n_ + p * kPanel, n_, cols);
      }
    }
  };
  shared_pool().run(run);
}

}  // namespace pyengine::cpu
