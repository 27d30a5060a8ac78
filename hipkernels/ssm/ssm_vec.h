// Device helpers of the Mamba2 recurrent-state kernels (causal_conv1d.hip, ssm_state.hip): SiLU,
// bf16 packing, vector accesses of V consecutive elements, and the dtype dispatch of a launch.
#pragma once

#include <cstdint>
#include <type_traits>

#include "common/hip_compat.h"

namespace pe_ssm {

PE_DEVICE float silu(float v) { return v / (1.f + __expf(-v)); }
// The same with the fast division (reciprocal and multiply): within 2 ulp of v / (1 + e^-v), and
// 0 where e^-v > 2^126 (v < -87: the exact value is below 1e-36 in magnitude). The IEEE division
// is an instruction sequence with a slow-path branch per channel on the critical path of
// conv1d_update_kernel's one-wave grid: batch 1, k = 3 went from 3.00 to 2.22 us with this, batch
// 64, k = 0 from 3.04 to 2.83 us (64-thread blocks). conv1d_fn_kernel uses it too (the same bits for
// a token in a prefill or a decode row); the other kernels keep the IEEE division.
// On NVIDIA e^-v is ex2.approx.ftz(-v log2 e), __expf without its subnormal-result fix-up
// instructions: it differs from __expf only where e^-v is subnormal (v > 87), and there 1 + e^-v
// rounds to 1 either way, so silu_fast gives the same bits with three instructions fewer.
PE_DEVICE float silu_fast(float v) {
#if defined(PE_CUDA) && defined(__CUDA_ARCH__)
  float e;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(v * -1.4426950408889634f));
  return __fdividef(v, 1.f + e);
#else
  return __fdividef(v, 1.f + __expf(-v));
#endif
}

// Two floats to two bf16 (low half = lo) in one conversion instruction where the chip has it
// (cvt.rn.bf16x2.f32, sm_80 and later): round to nearest even as pe_float_to_bf16_bits, the same
// bits for every non-NaN value (a NaN becomes the canonical 0x7fff, as PyTorch's own CUDA
// conversion gives, instead of the quieted input); elsewhere the two conversions of hip_compat.h.
PE_DEVICE uint32_t pack_bf16x2(float lo, float hi) {
#if defined(PE_CUDA) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
#else
  return (uint32_t)pe_float_to_bf16_bits(lo) | ((uint32_t)pe_float_to_bf16_bits(hi) << 16);
#endif
}

// V consecutive elements (conv channels, SSM state entries) in one access where V * sizeof(T) is
// 16 or 8 bytes, else element by element.
template <int BYTES>
struct RawVec {
  using type = void;
};
template <>
struct RawVec<16> {
  using type = uint4;
};
template <>
struct RawVec<8> {
  using type = uint2;
};
template <>
struct RawVec<4> {
  using type = uint32_t;
};
template <typename T, int V>
struct ChanVec {
  using Raw = typename RawVec<V * (int)sizeof(T)>::type;
  static PE_DEVICE void ld(const T* p, float* f) {
    if constexpr (std::is_void<Raw>::value) {
#pragma unroll
      for (int i = 0; i < V; ++i) f[i] = Io<T>::ld(p + i);
    } else {
      const Raw raw = *reinterpret_cast<const Raw*>(p);
      const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int i = 0; i < V; ++i) f[i] = Io<T>::ld(e + i);
    }
  }
  // the V elements unconverted (registers hold 16-bit values packed, two per register)
  static PE_DEVICE void ld_raw(const T* p, T* r) {
    if constexpr (std::is_void<Raw>::value) {
#pragma unroll
      for (int i = 0; i < V; ++i) r[i] = p[i];
    } else {
      *reinterpret_cast<Raw*>(r) = *reinterpret_cast<const Raw*>(p);
    }
  }
  static PE_DEVICE void st_raw(T* p, const T* r) {
    if constexpr (std::is_void<Raw>::value) {
#pragma unroll
      for (int i = 0; i < V; ++i) p[i] = r[i];
    } else {
      *reinterpret_cast<Raw*>(p) = *reinterpret_cast<const Raw*>(r);
    }
  }
  // st with the bf16 pairs packed by pack_bf16x2 (one instruction per pair on NVIDIA)
  static PE_DEVICE void st_packed(T* p, const float* f) {
    if constexpr (std::is_same<T, pe_bf16>::value && V % 2 == 0 && !std::is_void<Raw>::value) {
      Raw raw;
      uint32_t* w = reinterpret_cast<uint32_t*>(&raw);
#pragma unroll
      for (int i = 0; i < V / 2; ++i) w[i] = pack_bf16x2(f[2 * i], f[2 * i + 1]);
      *reinterpret_cast<Raw*>(p) = raw;
    } else {
      st(p, f);
    }
  }
  static PE_DEVICE void st(T* p, const float* f) {
    if constexpr (std::is_void<Raw>::value) {
#pragma unroll
      for (int i = 0; i < V; ++i) Io<T>::st(p + i, f[i]);
    } else {
      Raw raw;
      T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
      for (int i = 0; i < V; ++i) Io<T>::st(e + i, f[i]);
      *reinterpret_cast<Raw*>(p) = raw;
    }
  }
};

// Launch<T>::run(p, stream) for the params' dtype; -1 for an unknown one.
template <template <typename> class Launch, typename Params>
int dispatch(const Params& p, void* stream) {
  switch (p.dtype) {
    case PE_FLOAT32: return Launch<float>::run(p, static_cast<peStream_t>(stream));
    case PE_FLOAT16: return Launch<pe_half>::run(p, static_cast<peStream_t>(stream));
    case PE_BFLOAT16: return Launch<pe_bf16>::run(p, static_cast<peStream_t>(stream));
    default: return -1;
  }
}

}  // namespace pe_ssm
