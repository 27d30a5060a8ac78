// Element access and math shared by the CPU ops: bf16 <-> fp32 conversion, a branch-free expf,
// and the target_clones attribute that compiles each entry point for AVX-512, AVX2 and baseline
// x86-64 (picked at load time), so one build is fast on this CPU and still runs on any other.
//
// Everything here is always_inline: the loops must be compiled inside the cloned entry points to
// get their instruction set. Reductions use `#pragma omp simd` (built with -fopenmp-simd, no
// OpenMP runtime) and -fno-trapping-math (selects may be computed unconditionally): vectorised
// without -ffast-math, in an order fixed by the loop length alone.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#define PE_INLINE inline __attribute__((always_inline))
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define PE_CPU_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define PE_CPU_CLONES
#endif

namespace pyengine::cpu {

using bf16 = uint16_t;

PE_INLINE float to_float(float v) { return v; }
PE_INLINE float to_float(bf16 v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

template <typename T>
PE_INLINE T from_float(float f);
template <>
PE_INLINE float from_float<float>(float f) { return f; }
// Round to nearest even, NaN kept quiet: the same bits as torch's float -> bfloat16 cast.
template <>
PE_INLINE bf16 from_float<bf16>(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const uint32_t nan = (bits >> 16) | 0x40u;
  const uint32_t nan_mask = 0u - static_cast<uint32_t>((bits & 0x7fffffffu) > 0x7f800000u);  // select, no branch
  return static_cast<bf16>(rounded ^ ((rounded ^ nan) & nan_mask));
}

// exp(x) to about 2 ulp (Cody-Waite reduction + degree-6 polynomial), without branches so that
// loops over it vectorise. Inputs are clamped to the normal range: exp(-87.3) ~ 1e-38 stands in
// for smaller results, which only ever meet sums >= 1 here.
PE_INLINE float fast_exp(float x) {
  x = std::min(std::max(x, -87.3f), 88.3f);  // vectorise (std::fmin/fmax would be calls)
  const float n = std::floor(x * 1.44269504f + 0.5f);
  float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float r2 = r * r;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r2 + r + 1.0f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

}  // namespace pyengine::cpu
