// Asynchronous 16-byte global -> shared copies, shared by the kernels that stage tiles through
// shared memory (attention, the invariant GEMM). On NVIDIA (sm_80 and later) these are cp.async
// (zero-filled when the source is not valid, so that no byte outside the tensor is read); the
// portable fallback (HIP, older targets) copies synchronously through registers, and the barrier
// that follows each wait makes the stores visible exactly as with cp.async.
#pragma once

#include "common/hip_compat.h"

#if defined(PE_CUDA) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define PE_CP_ASYNC 1
#endif

namespace pe_copy {

PE_DEVICE void copy16_async(void* smem, const void* gmem, bool valid) {
#if defined(PE_CP_ASYNC)
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const int n = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(n) : "memory");
#else
  *reinterpret_cast<uint4*>(smem) = valid ? *reinterpret_cast<const uint4*>(gmem) : make_uint4(0u, 0u, 0u, 0u);
#endif
}

PE_DEVICE void copy_commit() {
#if defined(PE_CP_ASYNC)
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

// Waits until at most N of this thread's committed copy groups are still in flight.
template <int N>
PE_DEVICE void copy_wait() {
#if defined(PE_CP_ASYNC)
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

}  // namespace pe_copy
