// Paged KV-cache write of the MLA latent cache (GQA K/V are written by rope_and_cache, layer_ops/).
// Semantics in kv_cache_write.h. One block per token; threads copy the token's row in units of
// 16 bytes when every row start is 16-byte aligned, otherwise in units of the element size.
#include "common/hip_compat.h"
#include "attention/kv_cache_write.h"

namespace {

constexpr int kThreads = 128;

template <typename U>
__global__ void __launch_bounds__(kThreads) reshape_and_cache_mla_kernel(ReshapeAndCacheMlaParams p) {
  const int64_t t = blockIdx.x;
  const int64_t slot = p.slot_mapping[t];
  if (slot < 0) return;
  const int esz = p.elem_size;
  const int a_units = p.kv_lora_rank * esz / (int)sizeof(U);
  const int b_units = p.rope_dim * esz / (int)sizeof(U);
  const U* a = reinterpret_cast<const U*>(static_cast<const char*>(p.c_kv) + t * p.c_kv_stride_token * esz);
  const U* b = reinterpret_cast<const U*>(static_cast<const char*>(p.k_pe) + t * p.k_pe_stride_token * esz);
  U* dst = reinterpret_cast<U*>(static_cast<char*>(p.kv_cache) +
                                slot * (int64_t)(p.kv_lora_rank + p.rope_dim) * esz);
  for (int i = threadIdx.x; i < a_units + b_units; i += kThreads) {
    dst[i] = i < a_units ? a[i] : b[i - a_units];
  }
}

bool aligned(const void* ptr, int64_t bytes_multiple_of, int unit) {
  return reinterpret_cast<uintptr_t>(ptr) % unit == 0 && bytes_multiple_of % unit == 0;
}

}  // namespace

int launch_reshape_and_cache_mla(const ReshapeAndCacheMlaParams& p, void* stream) {
  if (p.num_tokens == 0) return 0;
  const peStream_t s = static_cast<peStream_t>(stream);
  const int esz = p.elem_size;
  const bool v16 = (int64_t)p.kv_lora_rank * esz % 16 == 0 && (int64_t)p.rope_dim * esz % 16 == 0 &&
                   p.c_kv_stride_token * esz % 16 == 0 && p.k_pe_stride_token * esz % 16 == 0 &&
                   aligned(p.c_kv, 0, 16) && aligned(p.k_pe, 0, 16) && aligned(p.kv_cache, 0, 16);
  const dim3 grid((unsigned)p.num_tokens);
  if (v16)
    reshape_and_cache_mla_kernel<uint4><<<grid, kThreads, 0, s>>>(p);
  else if (esz == 4)
    reshape_and_cache_mla_kernel<uint32_t><<<grid, kThreads, 0, s>>>(p);
  else
    reshape_and_cache_mla_kernel<uint16_t><<<grid, kThreads, 0, s>>>(p);
  return static_cast<int>(peGetLastError());
}
