// Per-token layer ops on the CPU: RMSNorm (with the residual add fused in), SwiGLU's activation,
// and RoPE fused with the KV-cache write. One pass over each token's row instead of the five to
// ten small torch ops (and their temporaries) each replaces; see layer_reference.py for semantics.
#include <algorithm>
#include <cmath>
#include <vector>

#include "common.h"
#include "cpu_ops.h"
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

template <typename T>
PE_INLINE void silu_and_mul_impl(const T* x, T* out, int32_t num_tokens, int32_t inter) {
  for (int32_t t = 0; t < num_tokens; ++t) {
    const T* gate = x + static_cast<int64_t>(t) * 2 * inter;
    const T* up = gate + inter;
    T* dst = out + static_cast<int64_t>(t) * inter;
#pragma omp simd
    for (int32_t i = 0; i < inter; ++i) {
      const float g = to_float(gate[i]);
      dst[i] = from_float<T>(g / (1.0f + fast_exp(-g)) * to_float(up[i]));
    }
  }
}

template <typename T>
PE_INLINE void rope_and_cache_impl(const RopeAndCacheParams& p) {
  T* qk = static_cast<T*>(p.qk);
  const T* v = static_cast<const T*>(p.v);
  const T* cos = static_cast<const T*>(p.cos);
  const T* sin = static_cast<const T*>(p.sin);
  T* k_cache = static_cast<T*>(p.k_cache);
  T* v_cache = static_cast<T*>(p.v_cache);
  const int32_t D = p.head_dim, half = D / 2, heads = p.num_heads + p.num_kv_heads;
  thread_local std::vector<float> rotated;
  rotated.resize(D);
  for (int32_t t = 0; t < p.num_tokens; ++t) {
    T* row = qk + t * p.qk_row_stride;
    if (cos) {
      const T* c = cos + static_cast<int64_t>(t) * D;
      const T* s = sin + static_cast<int64_t>(t) * D;
      for (int32_t hd = 0; hd < heads; ++hd) {
        T* x = row + static_cast<int64_t>(hd) * D;
#pragma omp simd
        for (int32_t d = 0; d < D; ++d) {
          const float partner = to_float(x[d < half ? d + half : d - half]);
          rotated[d] = to_float(x[d]) * to_float(c[d]) + partner * to_float(s[d]);
        }
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
PE_CPU_CLONES void silu_and_mul_f32(const void* x, void* out, int32_t n, int32_t inter) {
  silu_and_mul_impl(static_cast<const float*>(x), static_cast<float*>(out), n, inter);
}
PE_CPU_CLONES void silu_and_mul_bf16(const void* x, void* out, int32_t n, int32_t inter) {
  silu_and_mul_impl(static_cast<const bf16*>(x), static_cast<bf16*>(out), n, inter);
}
PE_CPU_CLONES void rope_and_cache_f32(const RopeAndCacheParams& p) { rope_and_cache_impl<float>(p); }
PE_CPU_CLONES void rope_and_cache_bf16(const RopeAndCacheParams& p) { rope_and_cache_impl<bf16>(p); }

}  // namespace

std::string rms_norm(const RmsNormParams& p) {
  if (p.hidden <= 0) return "rms_norm: hidden must be positive";
  p.dtype == DType::kBFloat16 ? rms_norm_bf16(p) : rms_norm_f32(p);
  return {};
}

void silu_and_mul(const void* x, void* out, int32_t num_tokens, int32_t inter, DType dtype) {
  dtype == DType::kBFloat16 ? silu_and_mul_bf16(x, out, num_tokens, inter)
                            : silu_and_mul_f32(x, out, num_tokens, inter);
}

std::string rope_and_cache(const RopeAndCacheParams& p) {
  if (p.head_dim % 2 != 0) return concat("rope_and_cache: head_dim must be even, got ", p.head_dim);
  for (int32_t t = 0; t < p.num_tokens; ++t)  // before anything is written
    if (p.slot_mapping[t] >= p.num_slots)
      return concat("slot_mapping[", t, "] = ", p.slot_mapping[t], " is outside the cache's ", p.num_slots, " slots");
  p.dtype == DType::kBFloat16 ? rope_and_cache_bf16(p) : rope_and_cache_f32(p);
  return {};
}

}  // namespace pyengine::cpu
