// Hopper's bulk tensor copies (TMA) and the shared-memory barriers (mbarrier) they complete on, for
// the wgmma GEMM (invariant_gemm_wgmma.hip). Device code of the sm_90a pass only (PE_TMA); nothing
// here exists for other targets or under hipcc.
//
// A pipeline stage has a "full" barrier (one arrival: the producer's arrive.expect_tx with the
// stage's bytes; the copies complete the transaction) and an "empty" barrier (one arrival per
// consumer warp once its tensor-core reads of the stage are done). A barrier's k-th completion has
// parity k % 2; wait(bar, parity) returns once the completion of that parity has happened.
#pragma once

#include <cstdint>

#include "common/hip_compat.h"

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

}  // namespace pe_tma
