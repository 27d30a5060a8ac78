// Warp-level tensor-core products (mma.sync, NVIDIA sm_80 and later) and the ldmatrix loads that
// feed them, for 16-bit operands (pe_half / pe_bf16) with fp32 accumulation. Fragment layouts are
// the PTX ISA's for m16n8k16: lane 4 g + q holds A rows g / g + 8, columns 2 q (+1) / 8 + 2 q (+1);
// B column g, rows 2 q (+1) / 8 + 2 q (+1); C rows g / g + 8, columns 2 q (+1). Other targets see
// empty bodies: their callers are compiled for NVIDIA only.
#pragma once

#include <type_traits>

#include "common/hip_compat.h"

namespace pe_mma {

// d (16 x 8) += a (16 x 16) * b (16 x 8), b given as its two registers.
template <typename T>
PE_DEVICE void mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (std::is_same<T, pe_bf16>::value)
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  else
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// Four 8x8 matrices of 16-bit values from shared memory; lane l gives the row address of matrix l / 8.
// kTrans: each matrix transposed, i.e. the B fragments of a matrix stored k-major (V of P V).
template <bool kTrans = false>
PE_DEVICE void ldsm_x4(uint32_t (&r)[4], const void* p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(p));
  if constexpr (kTrans)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
#endif
}

}  // namespace pe_mma
