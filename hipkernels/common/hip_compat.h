// Portability header: the kernels of hipkernels/ are written once in the HIP dialect and compiled
// with nvcc (NVIDIA, sm_90a) or hipcc (AMD, gfx90a). This header maps the few things that differ:
// runtime types, warp size, shuffles, and the 16-bit float types (bf16 is our own storage type,
// because ROCm 5.2's hip_bfloat16 and CUDA's __nv_bfloat16 do not share an interface).
#pragma once

#include <stdint.h>

#if defined(__HIPCC__) || defined(__HIP_PLATFORM_AMD__)
#include <hip/hip_runtime.h>
#include <hip/hip_fp16.h>
#define PE_HIP 1
typedef hipStream_t peStream_t;
typedef hipError_t peError_t;
typedef hipEvent_t peEvent_t;
#define peMemcpyAsync hipMemcpyAsync
#define peMemcpyDefault hipMemcpyDefault
#define peEventRecord hipEventRecord
#define peSuccess hipSuccess
#define peGetLastError hipGetLastError
#define peGetErrorString hipGetErrorString
#if defined(__AMDGCN_WAVEFRONT_SIZE)
#define PE_WARP_SIZE __AMDGCN_WAVEFRONT_SIZE
#else
#define PE_WARP_SIZE 64
#endif
#else
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#define PE_CUDA 1
typedef cudaStream_t peStream_t;
typedef cudaError_t peError_t;
typedef cudaEvent_t peEvent_t;
#define peMemcpyAsync cudaMemcpyAsync
#define peMemcpyDefault cudaMemcpyDefault
#define peEventRecord cudaEventRecord
#define peSuccess cudaSuccess
#define peGetLastError cudaGetLastError
#define peGetErrorString cudaGetErrorString
#define PE_WARP_SIZE 32
#endif

#define PE_DEVICE __device__ __forceinline__

// Butterfly shuffle inside the warp (all lanes of the warp must take part).
template <typename T>
PE_DEVICE T pe_shfl_xor(T v, int lane_mask) {
#if defined(PE_HIP)
  return __shfl_xor(v, lane_mask);
#else
  return __shfl_xor_sync(0xffffffffu, v, lane_mask);
#endif
}

// 16-bit storage types. half is the vendor type; bf16 is a plain 16-bit pattern.
typedef __half pe_half;
struct pe_bf16 {
  uint16_t x;
};

PE_DEVICE float pe_bf16_bits_to_float(uint32_t bits16) { return __uint_as_float(bits16 << 16); }

PE_DEVICE uint16_t pe_float_to_bf16_bits(float f) {  // round to nearest even, NaN kept quiet
  uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

// One element of a storage type <-> float (fp32 math everywhere; one rounding on store).
template <typename T>
struct Io;
template <>
struct Io<float> {
  static PE_DEVICE float ld(const float* p) { return *p; }
  static PE_DEVICE void st(float* p, float v) { *p = v; }
};
template <>
struct Io<pe_half> {
  static PE_DEVICE float ld(const pe_half* p) { return __half2float(*p); }
  static PE_DEVICE void st(pe_half* p, float v) { *p = __float2half_rn(v); }
};
template <>
struct Io<pe_bf16> {
  static PE_DEVICE float ld(const pe_bf16* p) { return pe_bf16_bits_to_float(p->x); }
  static PE_DEVICE void st(pe_bf16* p, float v) { p->x = pe_float_to_bf16_bits(v); }
};

// Eight 16-bit values in one 16-byte vector <-> eight floats.
template <typename T>
struct PeVec8;

template <>
struct PeVec8<pe_half> {
  static PE_DEVICE void to_float(const uint4& v, float* f) {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      __half2 h;
      __builtin_memcpy(&h, &w[i], 4);
      float2 p = __half22float2(h);
      f[2 * i] = p.x;
      f[2 * i + 1] = p.y;
    }
  }
  static PE_DEVICE float element_to_float(uint16_t bits) {
    __half h;
    __builtin_memcpy(&h, &bits, 2);
    return __half2float(h);
  }
  static PE_DEVICE uint16_t from_float(float f) {
    __half h = __float2half_rn(f);
    uint16_t b;
    __builtin_memcpy(&b, &h, 2);
    return b;
  }
};

template <>
struct PeVec8<pe_bf16> {
  static PE_DEVICE void to_float(const uint4& v, float* f) {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      f[2 * i] = __uint_as_float(w[i] << 16);
      f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
  }
  static PE_DEVICE float element_to_float(uint16_t bits) { return pe_bf16_bits_to_float(bits); }
  static PE_DEVICE uint16_t from_float(float f) { return pe_float_to_bf16_bits(f); }
};

// Programmatic dependent launch (CUDA, sm_90). A kernel launched with the PDL attribute may start
// while the previous kernel of its stream still runs: pe_pdl_wait() returns once that kernel has
// finished and its writes are visible, so what comes before it may read only data that no kernel
// of the step writes (weights). pe_pdl_launch_dependents() lets such a next kernel start now rather
// than at this kernel's end. Both do nothing under hipcc or for a kernel launched without PDL.
PE_DEVICE void pe_pdl_wait() {
#if defined(PE_CUDA) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

PE_DEVICE void pe_pdl_launch_dependents() {
#if defined(PE_CUDA) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// kernel<<<grid, block, smem, s>>>(args...), with programmatic dependent launch when pdl (CUDA;
// under hipcc always an ordinary launch). Returns the launch's error.
template <typename... Params, typename... Args>
peError_t pe_launch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, peStream_t s, bool pdl,
                    const Args&... args) {
#if defined(PE_CUDA)
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = s;
  cudaLaunchAttribute attr;
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = &attr;
  cfg.numAttrs = pdl ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kernel, args...);
#else
  (void)pdl;
  kernel<<<grid, block, smem, s>>>(args...);
  return hipGetLastError();
#endif
}

// Data type codes shared by the bindings and the Python wrappers.
enum PeDType { PE_FLOAT16 = 0, PE_BFLOAT16 = 1, PE_FLOAT32 = 2 };
