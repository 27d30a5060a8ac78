// Hopper's bulk tensor copies (TMA) and the shared-memory barriers (mbarrier) they complete on, for
// the wgmma GEMM (invariant_gemm_wgmma*.hip). Device code of the sm_90a pass only (PE_TMA), and the
// host's tensor-map encoding (CUDA builds); nothing here exists under hipcc.
//
// A pipeline stage has a "full" barrier (one arrival: the producer's arrive.expect_tx with the
// stage's bytes; the copies complete the transaction) and an "empty" barrier (one arrival per
// consumer warp once its tensor-core reads of the stage are done). A barrier's k-th completion has
// parity k % 2; wait(bar, parity) returns once the completion of that parity has happened.
#pragma once

#include <cstdint>

#include "common/hip_compat.h"

#if defined(PE_CUDA)
#include <cuda.h>
#include <cuda_runtime.h>
#endif

#if defined(PE_CUDA) && defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define PE_TMA 1
#endif

namespace pe_tma {

#if defined(PE_TMA)
PE_DEVICE uint32_t smem_addr(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

PE_DEVICE void init(uint64_t* bar, uint32_t arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(arrivals) : "memory");
}

// Makes the barriers' initialisation visible to the copy engine (then a block barrier publishes it).
PE_DEVICE void fence_init() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }

PE_DEVICE void arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1;\n}\n" ::"r"(smem_addr(bar)),
               "r"(bytes)
               : "memory");
}

PE_DEVICE void arrive(uint64_t* bar) {
  asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(smem_addr(bar)) : "memory");
}

PE_DEVICE void wait(uint64_t* bar, uint32_t parity) {
  uint32_t done;
  do {
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done)
                 : "r"(smem_addr(bar)), "r"(parity)
                 : "memory");
  } while (!done);
}

// One box of a 2-D tensor map (a __grid_constant__ kernel parameter) at element coordinates
// (c0: the contiguous dimension, c1) into shared memory at dst, completing on bar. Out-of-bounds
// elements are written as zeros and count towards the transaction's bytes.
PE_DEVICE void load_2d(void* dst, const void* tmap, uint64_t* bar, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];\n" ::"r"(
          smem_addr(dst)),
      "l"(reinterpret_cast<uint64_t>(tmap)), "r"(smem_addr(bar)), "r"(c0), "r"(c1)
      : "memory");
}

PE_DEVICE void prefetch_map(const void* tmap) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(tmap)) : "memory");
}

// A barrier over `threads` threads (a multiple of 32) of the block, id 1..15 (0 is __syncthreads').
PE_DEVICE void named_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// Waits until at most `pending` of this warpgroup's committed wgmma groups are still running.
template <int pending>
PE_DEVICE void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(pending) : "memory");
}
#endif

#if defined(PE_CUDA)
// Host side: the driver's tensor-map encoder (no libcuda link: the runtime hands out the entry
// point) and a 2-D map of a row-major matrix with the 128-byte swizzle the wgmma tiles read.
using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                 const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                 CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

inline EncodeTiled encoder() {
  static const EncodeTiled fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess)
      return (EncodeTiled) nullptr;
    return reinterpret_cast<EncodeTiled>(f);
  }();
  return fn;
}

// A 2-D row-major map (inner dimension `cols`, rows `row_elems` elements apart), box [box_rows][64].
inline bool encode(CUtensorMap* map, int dtype, const void* base, uint64_t cols, uint64_t rows, int64_t row_elems,
            uint32_t box_rows) {
  const cuuint64_t dims[2] = {cols, rows}, strides[1] = {(cuuint64_t)row_elems * 2};
  const cuuint32_t box[2] = {64, box_rows}, elem_strides[2] = {1, 1};
  return encoder()(map, dtype == PE_BFLOAT16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2,
                   const_cast<void*>(base), dims, strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                   CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                   CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}
#endif

}  // namespace pe_tma
