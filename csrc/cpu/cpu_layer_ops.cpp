// Per-token layer ops on the CPU: RMSNorm (with the residual add fused in), SwiGLU's activation,
// and RoPE fused with the KV-cache write. One pass over each token's row instead of the five to
// ten small torch ops (and their temporaries) each replaces; see pyengine/ops/reference/layer.py for semantics.
#include <algorithm>
#include <cmath>
#include <vector>

#include "common/common.h"
#include "cpu_ops.h"
#include "cpu_thread_pool.h"
#include "cpu_vec.h"

namespace pyengine::cpu {
namespace {

template <typename T>
PE_INLINE void rms_norm_impl(const RmsNormParams& p) {
  T* x = static_cast<T*>(p.x);
  T* res = static_cast<T*>(p.residual);
  T* out = p.out ? static_cast<T*>(p.out) : x;
  const T* w = static_cast<const T*>(p.weight);
  const int32_t H = p.hidden;
  thread_local std::vector<float> row;
  row.resize(H);
  for (int32_t t = 0; t < p.num_tokens; ++t) {
    const int64_t base = static_cast<int64_t>(t) * H;
    if (res) {
      // residual <- x + residual, rounded to T; the norm reads the rounded value (as unfused code).
#pragma omp simd
      for (int32_t i = 0; i < H; ++i) {
        res[base + i] = from_float<T>(to_float(x[base + i]) + to_float(res[base + i]));
        row[i] = to_float(res[base + i]);
      }
    } else {
#pragma omp simd
      for (int32_t i = 0; i < H; ++i) row[i] = to_float(x[base + i]);
    }
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int32_t i = 0; i < H; ++i) ss += row[i] * row[i];
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(H) + p.eps);
#pragma omp simd
    for (int32_t i = 0; i < H; ++i) out[base + i] = from_float<T>(row[i] * inv * to_float(w[i]));
  }
}

// Elements [begin, end) of the flat [T, I] output: element-wise, so any split gives the same bits.
template <typename T>
PE_INLINE void silu_and_mul_impl(const T* x, T* out, int32_t inter, int64_t begin, int64_t end) {
  while (begin < end) {
    const int64_t t = begin / inter, i0 = begin % inter, i1 = std::min<int64_t>(inter, i0 + (end - begin));
    const T* gate = x + t * 2 * inter;
    const T* up = gate + inter;
    T* dst = out + t * inter;
#pragma omp simd
    for (int64_t i = i0; i < i1; ++i) {
      const float g = to_float(gate[i]);
      dst[i] = from_float<T>(g / (1.0f + fast_exp(-g)) * to_float(up[i]));
    }
    begin += i1 - i0;
  }
}

// Tokens [t_begin, t_end). rotate_half pairs element d with d + D/2: two contiguous loops (a
// select between the halves kept the compiler from vectorising).
template <typename T>
PE_INLINE void rope_and_cache_impl(const RopeAndCacheParams& p, int32_t t_begin, int32_t t_end) {
  T* qk = static_cast<T*>(p.qk);
  const T* v = static_cast<const T*>(p.v);
  const T* cos = static_cast<const T*>(p.cos);
  const T* sin = static_cast<const T*>(p.sin);
  T* k_cache = static_cast<T*>(p.k_cache);
  T* v_cache = static_cast<T*>(p.v_cache);
  const int32_t D = p.head_dim, half = D / 2, heads = p.num_heads + p.num_kv_heads;
  thread_local std::vector<float> rotated;
  rotated.resize(D);
  for (int32_t t = t_begin; t < t_end; ++t) {
    T* row = qk + t * p.qk_row_stride;
    if (cos) {
      const int64_t at = p.positions ? p.positions[t] : t;
      const T* c = cos + at * D;
      const T* s = sin + at * D;
      for (int32_t hd = 0; hd < heads; ++hd) {
        T* x = row + static_cast<int64_t>(hd) * D;
#pragma omp simd
        for (int32_t d = 0; d < half; ++d)
          rotated[d] = to_float(x[d]) * to_float(c[d]) + to_float(x[d + half]) * to_float(s[d]);
#pragma omp simd
        for (int32_t d = half; d < D; ++d)
          rotated[d] = to_float(x[d]) * to_float(c[d]) + to_float(x[d - half]) * to_float(s[d]);
#pragma omp simd
        for (int32_t d = 0; d < D; ++d) x[d] = from_float<T>(rotated[d]);
      }
    }
    const int64_t slot = p.slot_mapping[t];
    if (slot < 0) continue;
    const int64_t width = static_cast<int64_t>(p.num_kv_heads) * D;
    std::copy_n(row + static_cast<int64_t>(p.num_heads) * D, width, k_cache + slot * width);
    std::copy_n(v + t * p.v_row_stride, width, v_cache + slot * width);
  }
}

PE_CPU_CLONES void rms_norm_f32(const RmsNormParams& p) { rms_norm_impl<float>(p); }
PE_CPU_CLONES void rms_norm_bf16(const RmsNormParams& p) { rms_norm_impl<bf16>(p); }
PE_CPU_CLONES void silu_and_mul_f32(const void* x, void* out, int32_t inter, int64_t begin, int64_t end) {
  silu_and_mul_impl(static_cast<const float*>(x), static_cast<float*>(out), inter, begin, end);
}
PE_CPU_CLONES void silu_and_mul_bf16(const void* x, void* out, int32_t inter, int64_t begin, int64_t end) {
  silu_and_mul_impl(static_cast<const bf16*>(x), static_cast<bf16*>(out), inter, begin, end);
}
PE_CPU_CLONES void rope_and_cache_f32(const RopeAndCacheParams& p, int32_t begin, int32_t end) {
  rope_and_cache_impl<float>(p, begin, end);
}
PE_CPU_CLONES void rope_and_cache_bf16(const RopeAndCacheParams& p, int32_t begin, int32_t end) {
  rope_and_cache_impl<bf16>(p, begin, end);
}

// Below this many elements a pool hand-off costs more than it saves.
constexpr int64_t kMinPoolElements = 8192;

// fn(begin, end) over [0, total), on the pool's threads when use_pool and the work is large enough.
template <typename Fn>
void split_over_pool(int64_t total, int64_t elements, bool use_pool, Fn&& fn) {
  if (!use_pool || elements < kMinPoolElements) return fn(int64_t{0}, total);
  shared_pool().run([&](int t, int nt) { fn(split_begin(total, t, nt), split_begin(total, t + 1, nt)); });
}

}  // namespace

std::string rms_norm(const RmsNormParams& p) {
  if (p.hidden <= 0) return "rms_norm: hidden must be positive";
  p.dtype == DType::kBFloat16 ? rms_norm_bf16(p) : rms_norm_f32(p);
  return {};
}

void silu_and_mul(const void* x, void* out, int32_t num_tokens, int32_t inter, DType dtype, bool use_pool) {
  const int64_t total = static_cast<int64_t>(num_tokens) * inter;
  split_over_pool(total, total, use_pool, [&](int64_t begin, int64_t end) {
    dtype == DType::kBFloat16 ? silu_and_mul_bf16(x, out, inter, begin, end) : silu_and_mul_f32(x, out, inter, begin, end);
  });
}

std::string rope_and_cache(const RopeAndCacheParams& p) {
  if (p.head_dim % 2 != 0) return concat("rope_and_cache: head_dim must be even, got ", p.head_dim);
  for (int32_t t = 0; t < p.num_tokens; ++t) {  // before anything is written
    if (p.slot_mapping[t] >= p.num_slots)
      return concat("slot_mapping[", t, "] = ", p.slot_mapping[t], " is outside the cache's ", p.num_slots, " slots");
    if (p.positions && p.cos && (p.positions[t] < 0 || p.positions[t] >= p.num_positions))
      return concat("positions[", t, "] = ", p.positions[t], " is outside the rotary tables' ", p.num_positions, " rows");
  }
  const int64_t elements = static_cast<int64_t>(p.num_tokens) * (p.num_heads + 2 * p.num_kv_heads) * p.head_dim;
  split_over_pool(p.num_tokens, elements, p.use_pool, [&](int64_t begin, int64_t end) {
    const auto b = static_cast<int32_t>(begin), e = static_cast<int32_t>(end);
    p.dtype == DType::kBFloat16 ? rope_and_cache_bf16(p, b, e) : rope_and_cache_f32(p, b, e);
  });
  return {};
}

}  // namespace pyengine::cpu
