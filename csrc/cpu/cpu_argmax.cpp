// Greedy sampling's two reductions of a logits row in one C++ call: its argmax (NumPy's: the first
// maximum, or the first NaN where there is one) and whether it is finite (no NaN, no +-inf).
//
// Why: a CPU decode step's argmax and finite check were eight NumPy / torch calls (the argmax, a
// second pass for the minimum, the index, two isfinite, their and, two wraps), each paying for the
// caches the step's weights had just flushed; here one call, two passes over a row in L2.
#include <cmath>
#include <cstdint>

#include "cpu_ops.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define PE_ARGMAX_AVX2 1
#endif

namespace pyengine::cpu {
namespace {

// Any row: NumPy's argmax (the first NaN, else the first maximum) and no NaN / inf anywhere.
void argmax_scalar(const float* x, int64_t n, int64_t* tok, bool* finite) {
  int64_t best = 0;
  bool ok = true;
  for (int64_t j = 0; j < n; ++j) {
    ok &= std::isfinite(x[j]);
    if (std::isnan(x[best])) continue;
    if (std::isnan(x[j]) || x[j] > x[best]) best = j;
  }
  *tok = best, *finite = ok;
}

#ifdef PE_ARGMAX_AVX2
// A finite row's maximum by 8 lanes, then its first index; a row holding NaN or inf goes to the
// scalar loop (the same answer).
__attribute__((target("avx2"))) void argmax_avx2(const float* x, int64_t n, int64_t* tok, bool* finite) {
  const __m256 sign = _mm256_set1_ps(-0.0f), inf = _mm256_set1_ps(INFINITY);
  __m256 vmax = _mm256_set1_ps(-INFINITY), bad = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 v = _mm256_loadu_ps(x + j);
    vmax = _mm256_max_ps(vmax, v);
    bad = _mm256_or_ps(bad, _mm256_cmp_ps(_mm256_andnot_ps(sign, v), inf, _CMP_NLT_UQ));  // NaN or |v| = inf
  }
  bool tail_ok = true;
  float m = -INFINITY;
  for (int64_t t = j; t < n; ++t) tail_ok &= std::isfinite(x[t]), m = std::max(m, x[t]);
  if (_mm256_movemask_ps(bad) || !tail_ok) return argmax_scalar(x, n, tok, finite);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vmax);
  for (const float l : lanes) m = std::max(m, l);
  const __m256 target = _mm256_set1_ps(m);
  for (j = 0; j + 8 <= n; j += 8) {
    const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + j), target, _CMP_EQ_OQ));
    if (hit) {
      *tok = j + __builtin_ctz(hit), *finite = true;
      return;
    }
  }
  for (; j < n && x[j] != m; ++j) {
  }
  *tok = j, *finite = true;
}
#endif

}  // namespace

void argmax_rows(const float* x, int64_t rows, int64_t cols, int64_t row_stride, int64_t* tok, bool* finite) {
#ifdef PE_ARGMAX_AVX2
  static const bool avx2 = __builtin_cpu_supports("avx2");
#else
  constexpr bool avx2 = false;
#endif
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x + r * row_stride;
    if (cols <= 0) {
      tok[r] = 0, finite[r] = true;
      continue;
    }
#ifdef PE_ARGMAX_AVX2
    if (avx2) {
      argmax_avx2(row, cols, tok + r, finite + r);
      continue;
    }
#endif
    argmax_scalar(row, cols, tok + r, finite + r);
  }
}

}  // namespace pyengine::cpu
