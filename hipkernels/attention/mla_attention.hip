// Launch of the MLA decode kernels (semantics: mla_attention.h): picks the tile (mla_decode_fast.hip
// on sm_90a, mla_decode_small.hip elsewhere or under p.mla_small_tile), checks the accumulator pool,
// and runs the split-KV combine for the rows whose ranges went to the workspace.
#include "common/hip_compat.h"
#include "attention/mla_attention.h"
#include "attention/mla_kernels.h"
#include "attention/mla_tile.h"
#include "attention/paged_attention.h"

#include <algorithm>
#include <map>
#include <mutex>

namespace {

using pe_mla::kDqk;
using pe_mla::kDv;

// The small tile: always under hipcc (the fast one is not even compiled there: its 226 KB never fit
// a gfx90a block); on NVIDIA when p.mla_small_tile asks for it (tests run both paths in one process)
// or when the device cannot give a block the fast tile's shared memory (builds for targets other
// than sm_90a).
#if !defined(PE_HIP)
bool use_small_tile(const PagedAttentionParams& p) {
  if (p.mla_small_tile) return true;
  int dev = 0, optin = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess)
    return false;  // let the launch report the error
  return optin < pe_mla::FastTile::kSmemBytes;
}
#endif

}  // namespace

int launch_mla_grid(void (*kernel)(PagedAttentionParams), int m_tile, int threads, int smem,
                    const PagedAttentionParams& p, peStream_t s) {
  const void* fn = reinterpret_cast<const void*>(kernel);
#if defined(PE_HIP)
  peError_t rc = hipFuncSetAttribute(fn, hipFuncAttributeMaxDynamicSharedMemorySize, smem);
#else
  peError_t rc = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
#endif
  if (rc != peSuccess) return static_cast<int>(rc);
  // Every resident block may hold a slab: the pool must have one per resident block, or a block
  // could wait for a slab that no running block will free.
  // Resident blocks per device, queried once per kernel (the first launch runs eagerly, before any
  // CUDA-graph capture; one device kind per process).
  static std::mutex mu;
  static std::map<const void*, int64_t> resident;
  int64_t blocks = 0;
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = resident.find(fn);
    if (it == resident.end()) {
      int dev = 0, sms = 0, per_sm = 0;
#if defined(PE_HIP)
      rc = hipGetDevice(&dev);
      if (rc == peSuccess) rc = hipDeviceGetAttribute(&sms, hipDeviceAttributeMultiprocessorCount, dev);
      if (rc == peSuccess) rc = hipOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem);
#else
      rc = cudaGetDevice(&dev);
      if (rc == peSuccess) rc = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
      if (rc == peSuccess) rc = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem);
#endif
      if (rc != peSuccess) return static_cast<int>(rc);
#if !defined(PE_HIP)
      // The slabs are accessed with L2 evict_last (mla_slab.h), which keeps lines only inside the
      // device's persisting L2 set-aside (0 by default): without one, the range folds write the slabs
      // back to HBM and read them again (~185 MB at batch 64, context 4096). Sets it to the pool's
      // size (at most the device's maximum) unless it is already larger; best effort.
      size_t have = 0;
      int most = 0;
      if (cudaDeviceGetLimit(&have, cudaLimitPersistingL2CacheSize) == cudaSuccess &&
          cudaDeviceGetAttribute(&most, cudaDevAttrMaxPersistingL2CacheSize, dev) == cudaSuccess) {
        const size_t want = std::min((size_t)most, (size_t)p.mla_acc_floats * sizeof(float));
        if (have < want && cudaDeviceSetLimit(cudaLimitPersistingL2CacheSize, want) != cudaSuccess)
          (void)cudaGetLastError();
      } else {
        (void)cudaGetLastError();
      }
#endif
      it = resident.emplace(fn, (int64_t)per_sm * sms).first;
    }
    blocks = it->second;
  }
  const int64_t slabs = p.mla_acc_floats / ((int64_t)m_tile * kDv);
  if (p.mla_acc == nullptr || p.mla_locks == nullptr || blocks > slabs || blocks > p.mla_lock_count)
    return -1;
  const int m_tiles = (p.max_query_len * p.num_q_heads + m_tile - 1) / m_tile;
  // Pair tiles fastest: the tiles of one (row, range) run side by side and share its keys in L2.
  const dim3 grid((unsigned)m_tiles, (unsigned)(p.mla_walk ? 1 : p.max_splits), (unsigned)p.num_rows);
  kernel<<<grid, threads, smem, s>>>(p);
  return static_cast<int>(peGetLastError());
}

int launch_mla_attention(const PagedAttentionParams& p, void* stream) {
  if (p.num_rows == 0 || p.max_query_len == 0) return 0;
  // fixed_splits: the combine merges workspace partials in range order (merge_range), the merge the
  // walking blocks perform; a walking step (fixed rule only) has no workspace partials (max_splits 1).
  if (p.num_kv_heads != 1 || p.head_dim_qk != kDqk || p.head_dim_v != kDv || p.num_q_heads <= 0 ||
      p.max_splits < 1 || p.split_block < 64 || p.split_block % 64 != 0 ||
      (p.mla_walk && (p.max_splits != 1 || !p.fixed_splits)) || (p.dtype != PE_FLOAT16 && p.dtype != PE_BFLOAT16))
    return -1;
  const peStream_t s = static_cast<peStream_t>(stream);
#if !defined(PE_HIP)
  int rc = use_small_tile(p) ? launch_mla_small(p, s) : launch_mla_fast(p, s);
#else
  int rc = launch_mla_small(p, s);
#endif
  if (rc != 0) return rc;
  return launch_paged_attention_combine(p, stream);
}
