// The decode GEMM of cpu_gemm.h: AVX-512 (BF16) micro-kernels of up to 16 rows x 16 columns
// (16 zmm accumulators, the weights streamed once, x broadcast from L1), threads splitting the
// panels into contiguous ranges. CPUs without them run cpu_gemm_avx2.h's kernels on the same panels.
#include "cpu_gemm.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "common/common.h"
#include "cpu_gemm_avx2.h"
#include "cpu_thread_pool.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define PE_HAVE_GEMM 1  // elsewhere has_gemm() is false and Python keeps oneDNN or dense weights
#endif

namespace pyengine::cpu {
namespace {

constexpr int kPanel = kPanelCols;

#ifdef PE_HAVE_GEMM
constexpr int kRows = kGemmRows;
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

// fp32: one k per 64-byte line (16 columns), one FMA per row with x[r][k] broadcast.
template <int R>
__attribute__((target("avx512f"))) void micro_kernel_f32(const float* x, int64_t x_row_stride, const uint32_t* panel,
                                                         int64_t k_steps, const float* bias, float* y,
                                                         int64_t y_row_stride, int cols) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const float* w = reinterpret_cast<const float*>(panel);
  for (int64_t k = 0; k < k_steps; ++k) {
    _mm_prefetch(reinterpret_cast<const char*>(w + (k + kPrefetchLines) * kPanel), _MM_HINT_T0);
    const __m512 wk = _mm512_loadu_ps(w + k * kPanel);
    for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * x_row_stride + k]), wk, acc[r]);
  }
  const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1u);
  const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias) : _mm512_setzero_ps();
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + r * y_row_stride, mask, _mm512_add_ps(acc[r], b));
}

template <typename T>
using MicroKernel = void (*)(const T*, int64_t, const uint32_t*, int64_t, const T*, T*, int64_t, int);
static_assert(std::is_same_v<MicroKernel<float>, F32MicroKernel>);

template <int... R>
constexpr auto make_bf16_kernels(std::integer_sequence<int, R...>) {
  return std::array<MicroKernel<bf16>, sizeof...(R)>{&micro_kernel<R + 1>...};
}
template <int... R>
constexpr auto make_f32_kernels(std::integer_sequence<int, R...>) {
  return F32MicroKernels{&micro_kernel_f32<R + 1>...};
}
const auto kBf16Kernels = make_bf16_kernels(std::make_integer_sequence<int, kRows>{});
const auto kF32Kernels = make_f32_kernels(std::make_integer_sequence<int, kRows>{});

// Rows of x through one panel (panel_words uint32 apart) at a time; threads take contiguous panel
// ranges. k_steps: the kernels' K (k pairs for bf16).
template <typename T>
void run_panels(const std::array<MicroKernel<T>, kRows>& kernels, const uint32_t* packed, int64_t panels,
                int64_t panel_words, int64_t k_steps, int64_t n, const T* x, int64_t x_row_stride, int64_t m,
                const T* bias, T* y, bool interleave_x = false) {
  auto run = [&](int t, int nt) {
    const int64_t begin = split_begin(panels, t, nt), end = split_begin(panels, t + 1, nt);
    if (begin == end) return;
    const T* xs = x;  // row tile r0 / 16 starts at xs + r0 / 16 * tile_stride
    int64_t tile_stride = kRows * x_row_stride;
    if constexpr (std::is_same_v<T, float>) {
      if (interleave_x && m > 1) {  // each thread its own copy (about a microsecond per 16 x 576 tile);
                                    // one row is its own interleaved layout
        thread_local std::vector<float> tiles;
        tiles.resize(static_cast<size_t>(m * k_steps));
        interleave_rows(x, x_row_stride, m, k_steps, tiles.data());
        xs = tiles.data(), tile_stride = k_steps * kRows;
      }
    }
    for (int64_t p = begin; p < end; ++p) {
      const int cols = static_cast<int>(std::min<int64_t>(kPanel, n - p * kPanel));
      const uint32_t* panel = packed + p * panel_words;
      for (int64_t r0 = 0; r0 < m; r0 += kRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kRows, m - r0));
        kernels[rows - 1](xs + (r0 / kRows) * tile_stride, x_row_stride, panel, k_steps,
                          bias ? bias + p * kPanel : nullptr, y + r0 * n + p * kPanel, n, cols);
      }
    }
  };
  shared_pool().run(run);
}
#endif  // PE_HAVE_GEMM

}  // namespace

GemmIsa gemm_isa(DType dtype) {
#ifdef PE_HAVE_GEMM
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl");
  if (avx512 && (dtype == DType::kFloat32 || __builtin_cpu_supports("avx512bf16"))) return GemmIsa::kAvx512;
  if (has_avx2_gemm()) return GemmIsa::kAvx2;
#else
  (void)dtype;
#endif
  return GemmIsa::kNone;
}

bool has_gemm(DType dtype) { return gemm_isa(dtype) != GemmIsa::kNone; }

std::string PackedWeight::check(int64_t k, int64_t n, DType dtype) {
  if (k <= 0 || n <= 0) return concat("packed weight needs K, N > 0, got ", k, " x ", n);
  if (dtype == DType::kBFloat16 && k % 2 != 0) return concat("a packed bf16 weight needs an even K, got ", k);
  if (!has_gemm(dtype)) return "this CPU lacks the instructions of the packed GEMM";
  return {};
}

namespace {
// gemm_isa(dtype), or the AVX2 + FMA kernels where isa_limit asks for them and the CPU has them.
GemmIsa limited_isa(DType dtype, GemmIsa isa_limit) {
  const GemmIsa best = gemm_isa(dtype);
  return isa_limit <= GemmIsa::kAvx2 && best > GemmIsa::kAvx2 && has_avx2_gemm() ? GemmIsa::kAvx2 : best;
}
}  // namespace

PackedWeight::PackedWeight(const void* w, int64_t k, int64_t n, DType dtype, bool compact, GemmIsa isa_limit)
    : k_(k),
      n_(n),
      k_steps_(dtype == DType::kBFloat16 ? k / 2 : k),
      panels_(ceil_div(n, kPanel)),
      dtype_(dtype),
      isa_(limited_isa(dtype, isa_limit)) {
  if (!check(k, n, dtype).empty()) {  // the binding checks first; an empty weight computes nothing
    k_ = n_ = k_steps_ = panels_ = 0;
    return;
  }
  if (compact && dtype == DType::kFloat32)
    for (const PanelFormat f : {PanelFormat::kAffine4, PanelFormat::kAffine8})
      if (pack_affine(static_cast<const float*>(w), k, n, f, packed_, isa_ == GemmIsa::kAvx2)) {
        format_ = f;
        return;
      }
  packed_.clear();
  packed_.assign(static_cast<size_t>(panels_ * k_steps_ * kPanel), 0u);
  for (int64_t p = 0; p < panels_; ++p)
    for (int64_t ks = 0; ks < k_steps_; ++ks)
      for (int c = 0; c < kPanel && p * kPanel + c < n; ++c) {
        const int64_t col = p * kPanel + c;
        uint32_t& dst = packed_[(p * k_steps_ + ks) * kPanel + c];
        if (dtype == DType::kBFloat16) {  // the (w[2k], w[2k+1]) pair of vdpbf16ps
          const bf16* wb = static_cast<const bf16*>(w);
          dst = static_cast<uint32_t>(wb[(2 * ks) * n + col]) | (static_cast<uint32_t>(wb[(2 * ks + 1) * n + col]) << 16);
        } else {
          std::memcpy(&dst, static_cast<const float*>(w) + ks * n + col, sizeof(dst));
        }
      }
}

std::optional<PackedWeight> PackedWeight::from_gguf(const GgufRows& rows, int64_t k, int64_t n, int act_bits,
                                                    GemmIsa isa_limit) {
  if (!check(k, n, DType::kFloat32).empty()) return std::nullopt;
  PackedWeight w(nullptr, 0, 1, DType::kFloat32, false);  // an empty weight (check fails: nothing read)
  if ((act_bits == 8 || act_bits == 32) && pack_gguf_qdot(rows, k, n, w.packed_)) {
    w.qdot_act_bits_ = act_bits;
    // AVX2 kernels on every CPU, the int16x2 ones on AVX-512 VNNI / AMX where it has them: the same bits
    w.isa_ = act_bits == 32 ? static_cast<GemmIsa>(qdot16_isa(static_cast<int>(isa_limit))) : GemmIsa::kAvx2;
  } else {
    w.isa_ = limited_isa(DType::kFloat32, isa_limit);
    if (!pack_gguf_rows(rows, k, n, w.packed_, w.isa_ == GemmIsa::kAvx2)) return std::nullopt;
  }
  w.k_ = w.k_steps_ = k, w.n_ = n, w.panels_ = ceil_div(n, kPanel), w.format_ = gguf_panel_format(rows.ggml_type);
  return w;
}

bool PackedWeight::columns(const int64_t* ids, int64_t count, float* out) const {
  if (dtype_ != DType::kFloat32 || format_ == PanelFormat::kDense) return false;
  if (qdot_act_bits_ != 0)
    return qdot_columns(reinterpret_cast<const uint8_t*>(packed_.data()), format_ == PanelFormat::kAffine4 ? 4 : 8, k_,
                        n_, ids, count, out);
  return packed_columns(packed_.data(), format_, k_, n_, ids, count, out, paired());
}

void PackedWeight::matmul(const void* x, int64_t x_row_stride, int64_t m, const void* bias, void* y) const {
  if (m <= 0 || panels_ == 0) return;  // panels_ == 0 also wherever check() fails (no PE_HAVE_GEMM)
#ifdef PE_HAVE_GEMM
  const auto* xf = static_cast<const float*>(x);
  const auto* bf = static_cast<const float*>(bias);
  auto* yf = static_cast<float*>(y);
  if (qdot_act_bits_ != 0) {
    qdot_matmul(reinterpret_cast<const uint8_t*>(packed_.data()), format_ == PanelFormat::kAffine4 ? 4 : 8, k_, n_, xf,
                x_row_stride, m, bf, yf, qdot_act_bits_, static_cast<int>(isa_));
    return;
  }
  if (isa_ == GemmIsa::kAvx2) {
    if (dtype_ == DType::kBFloat16)
      avx2_matmul_bf16(packed_.data(), k_, n_, static_cast<const bf16*>(x), x_row_stride, m,
                       static_cast<const bf16*>(bias), static_cast<bf16*>(y));
    else
      avx2_matmul_f32(packed_.data(), format_, paired(), k_, n_, xf, x_row_stride, m, bf, yf);
    return;
  }
  if (dtype_ == DType::kBFloat16)
    run_panels(kBf16Kernels, packed_.data(), panels_, k_steps_ * kPanel, k_steps_, n_, static_cast<const bf16*>(x),
               x_row_stride, m, static_cast<const bf16*>(bias), static_cast<bf16*>(y));
  else if (format_ == PanelFormat::kDense)
    run_panels(kF32Kernels, packed_.data(), panels_, k_steps_ * kPanel, k_steps_, n_, xf, x_row_stride, m, bf, yf);
  else
    run_panels(affine_kernels(format_), packed_.data(), panels_, k_ / kAffineRun * affine_block_words(format_), k_,
               n_, xf, x_row_stride, m, bf, yf, /*interleave_x=*/true);
#else
  (void)x, (void)x_row_stride, (void)bias, (void)y;
#endif
}

}  // namespace pyengine::cpu
