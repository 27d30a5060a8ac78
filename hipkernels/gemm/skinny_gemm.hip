// Skinny GEMM for decode (semantics and reduction order in skinny_gemm.h).
//
// Work split. A block owns kTileN = 8 * L output columns, up to MB rows of M and one of `split`
// ranges of K. Its 256 threads form groups of L lanes; a group reads one K row of the tile per
// access (L lanes x 16 bytes: 128 or 256 contiguous bytes), and takes the range's 8-row runs
// group, group + groups, ... so every weight byte is read once, in full cache lines. Decode is
// bound by the weight stream: each thread keeps one run (8 x 16 bytes) in flight, and enough
// blocks are resident that the device holds many MB of loads in flight.
//
// Rows of M beyond MB run as further blocks over the same tiles (the weights are re-read, mostly
// from L2: those blocks are adjacent in launch order). MB only changes how many rows one block
// carries, never a row's arithmetic, which keeps a row's result independent of the batch.
#include "gemm/skinny_gemm.h"

#include "common/hip_compat.h"

#if defined(PE_CUDA)
#include <cooperative_groups.h>
#endif

namespace {

constexpr int kThreads = 256;
constexpr int kRun = 8;       // consecutive K rows per step of a thread (one 16-byte x load per row of M)
constexpr int kMaxRows = 8;   // rows of M per block (MB); accumulators are MB x 8 floats per thread
constexpr int kMaxSplit = 8;  // portable cluster size
constexpr int64_t kPrefetchChunk = 64 << 10;  // bytes per bulk L2 prefetch instruction

template <typename T>
PE_DEVICE float half_bits_to_float(uint32_t bits16);
template <>
PE_DEVICE float half_bits_to_float<pe_bf16>(uint32_t bits16) { return pe_bf16_bits_to_float(bits16); }
template <>
PE_DEVICE float half_bits_to_float<pe_half>(uint32_t bits16) {
  const uint16_t b = (uint16_t)bits16;
  __half h;
  __builtin_memcpy(&h, &b, 2);
  return __half2float(h);
}

// Element j (compile-time) of eight 16-bit values packed in a 16-byte vector.
template <typename T, int J>
PE_DEVICE float element(const uint4& v) {
  const uint32_t word = J / 2 == 0 ? v.x : J / 2 == 1 ? v.y : J / 2 == 2 ? v.z : v.w;
  return half_bits_to_float<T>(J % 2 == 0 ? (word & 0xffffu) : (word >> 16));
}

// Weights are read once per step and never written by a kernel: the read-only path.
PE_DEVICE uint4 load_weight(const uint4* p) {
#if defined(PE_CUDA)
  return __ldg(p);
#else
  return *p;
#endif
}

// x comes from the previous kernel (visible after pe_pdl_wait): read through L2 only.
PE_DEVICE uint4 load_act(const uint4* p) {
#if defined(PE_CUDA)
  return __ldcg(p);
#else
  return *p;
#endif
}

// acc[m][c] += x[m][row j] * w[row j][c] for the 8 rows of one run, rows in order.
template <typename T, int MB, int J = 0>
PE_DEVICE void fma_run(float (&acc)[MB][8], const uint4 (&wv)[kRun], const uint4 (&xv)[MB]) {
  if constexpr (J < kRun) {
    float wf[8];
    PeVec8<T>::to_float(wv[J], wf);
#pragma unroll
    for (int mm = 0; mm < MB; ++mm) {
      const float xj = element<T, J>(xv[mm]);
#pragma unroll
      for (int c = 0; c < 8; ++c) acc[mm][c] = fmaf(xj, wf[c], acc[mm][c]);
    }
    fma_run<T, MB, J + 1>(acc, wv, xv);
  }
}

// This block's share of p.prefetch, pulled into L2 by the bulk copy engine (fire and forget: no
// register or barrier waits for it). Issued last, it streams while the latency-bound kernels
// between this GEMM and the one that reads it (RoPE, attention) leave HBM idle.
PE_DEVICE void prefetch_share(const SkinnyGemmParams& p) {
#if defined(PE_CUDA) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (p.prefetch_bytes <= 0 || threadIdx.x != 0) return;
  const int64_t blocks = (int64_t)gridDim.x * gridDim.y, id = (int64_t)blockIdx.y * gridDim.x + blockIdx.x;
  const int64_t share = (p.prefetch_bytes / 16 + blocks - 1) / blocks * 16;  // whole 16-byte units
  const int64_t begin = id * share;
  const int64_t end = begin + share < p.prefetch_bytes ? begin + share : p.prefetch_bytes;
  for (int64_t off = begin; off < end; off += kPrefetchChunk) {
    const uint32_t bytes = (uint32_t)(end - off < kPrefetchChunk ? end - off : kPrefetchChunk);
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;"
                 :: "l"(static_cast<const char*>(p.prefetch) + off), "r"(bytes) : "memory");
  }
#else
  (void)p;
#endif
}

template <typename T, int MB, int L>
__global__ void __launch_bounds__(kThreads) skinny_gemm_kernel(SkinnyGemmParams p, int row_blocks) {
  constexpr int kTileN = 8 * L;
  constexpr int kGroups = kThreads / L;
  constexpr int kWarps = kThreads / PE_WARP_SIZE;
  static_assert(PE_WARP_SIZE % L == 0, "a K row of the tile lies inside one warp");
  __shared__ float warp_sums[kWarps][MB][kTileN];
  __shared__ float block_sum[MB][kTileN];

  const int tile = blockIdx.x / row_blocks;
  const int m0 = (blockIdx.x - tile * row_blocks) * MB;
  const int rows = p.m - m0 < MB ? p.m - m0 : MB;
  const int split = blockIdx.y, splits = gridDim.y;  // cluster (1, splits): block rank == split
  const int lane = threadIdx.x % L;
  const int col = tile * kTileN + lane * 8;
  const bool active = col < p.n;
  const int runs = p.k / kRun;
  const int run_end = (int)((int64_t)runs * (split + 1) / splits);
  int run = (int)((int64_t)runs * split / splits) + (int)threadIdx.x / L;

  const int64_t w_row = p.n / 8;  // 16-byte vectors per weight row
  const uint4* w = static_cast<const uint4*>(p.w) + col / 8;
  using Raw = uint16_t;
  const Raw* x = static_cast<const Raw*>(p.x) + (int64_t)m0 * p.x_stride;
  uint4 wv[kRun], xv[MB];
  const auto load_w = [&](int r) {
#pragma unroll
    for (int j = 0; j < kRun; ++j) wv[j] = load_weight(w + ((int64_t)r * kRun + j) * w_row);
  };
  const auto load_x = [&](int r) {
#pragma unroll
    for (int mm = 0; mm < MB; ++mm)
      xv[mm] = mm < rows ? load_act(reinterpret_cast<const uint4*>(x + mm * p.x_stride + (int64_t)r * kRun))
                         : make_uint4(0, 0, 0, 0);
  };

  // The first run's weights are in flight before the wait: under PDL they stream in while the
  // kernel that writes x is still running. A PDL-launched successor (the next projection) may
  // likewise start as soon as every block of this one runs: the weight stream never pauses.
  pe_pdl_launch_dependents();
  if (active && run < run_end) load_w(run);
  pe_pdl_wait();
  if (active && run < run_end) load_x(run);
  float acc[MB][8];
#pragma unroll
  for (int mm = 0; mm < MB; ++mm)
#pragma unroll
    for (int c = 0; c < 8; ++c) acc[mm][c] = 0.f;
  for (; active && run < run_end; run += kGroups) {
    fma_run<T, MB>(acc, wv, xv);
    if (run + kGroups < run_end) {
      load_w(run + kGroups);
      load_x(run + kGroups);
    }
  }

  // Groups of one warp: a butterfly (every lane ends with the same, identically ordered sum).
#pragma unroll
  for (int o = L; o < PE_WARP_SIZE; o <<= 1)
#pragma unroll
    for (int mm = 0; mm < MB; ++mm)
#pragma unroll
      for (int c = 0; c < 8; ++c) acc[mm][c] += pe_shfl_xor(acc[mm][c], o);
  const int warp = threadIdx.x / PE_WARP_SIZE;
  if (threadIdx.x % PE_WARP_SIZE < L)
#pragma unroll
    for (int mm = 0; mm < MB; ++mm)
#pragma unroll
      for (int c = 0; c < 8; ++c) warp_sums[warp][mm][lane * 8 + c] = acc[mm][c];
  __syncthreads();
  // Warps in order.
  for (int i = threadIdx.x; i < MB * kTileN; i += kThreads) {
    const int mm = i / kTileN, c = i % kTileN;
    float s = warp_sums[0][mm][c];
    for (int v = 1; v < kWarps; ++v) s += warp_sums[v][mm][c];
    block_sum[mm][c] = s;
  }

  // K ranges in order. With a split, block `split` of the cluster finishes columns
  // [split * kTileN / splits, (split + 1) * kTileN / splits) from every block's shared memory.
  const int cols = kTileN / splits;
#if defined(PE_CUDA)
  cooperative_groups::cluster_group cluster = cooperative_groups::this_cluster();
  if (splits > 1)
    cluster.sync();  // every block's block_sum is complete
  else
    __syncthreads();
  const auto part = [&](int s, int mm, int c) {
    return splits > 1 ? *cluster.map_shared_rank(&block_sum[mm][c], s) : block_sum[mm][c];
  };
#else
  __syncthreads();
  const auto part = [&](int, int mm, int c) { return block_sum[mm][c]; };
#endif
  Raw* y = static_cast<Raw*>(p.y);
  for (int i = threadIdx.x; i < MB * cols; i += kThreads) {
    const int mm = i / cols, c = split * cols + i % cols;
    const int gcol = tile * kTileN + c;
    if (mm >= rows || gcol >= p.n) continue;
    float v = part(0, mm, c);
    for (int s = 1; s < splits; ++s) v += part(s, mm, c);
    if (p.bias != nullptr) v += half_bits_to_float<T>(static_cast<const Raw*>(p.bias)[gcol]);
    y[(int64_t)(m0 + mm) * p.y_stride + gcol] = PeVec8<T>::from_float(v);
  }
#if defined(PE_CUDA)
  if (splits > 1) cluster.sync();  // no block leaves while another still reads its shared memory
#endif
  prefetch_share(p);
}

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

template <typename T, int MB, int L>
int launch_typed(const SkinnyGemmParams& p, int splits, peStream_t s) {
  const int tiles = (p.n + 8 * L - 1) / (8 * L);
  const int row_blocks = (p.m + MB - 1) / MB;
  const dim3 grid((unsigned)(tiles * row_blocks), (unsigned)splits);
#if defined(PE_CUDA)
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(kThreads);
  cfg.stream = s;
  cudaLaunchAttribute attrs[2];
  unsigned n = 0;
  if (splits > 1) {
    attrs[n].id = cudaLaunchAttributeClusterDimension;
    attrs[n].val.clusterDim.x = 1;
    attrs[n].val.clusterDim.y = (unsigned)splits;
    attrs[n].val.clusterDim.z = 1;
    ++n;
  }
  if (p.pdl) {
    attrs[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attrs[n].val.programmaticStreamSerializationAllowed = 1;
    ++n;
  }
  cfg.attrs = attrs;
  cfg.numAttrs = n;
  const cudaError_t rc = cudaLaunchKernelEx(&cfg, skinny_gemm_kernel<T, MB, L>, p, row_blocks);
  return rc != cudaSuccess ? (int)rc : (int)peGetLastError();
#else
  skinny_gemm_kernel<T, MB, L><<<grid, kThreads, 0, s>>>(p, row_blocks);
  return (int)peGetLastError();
#endif
}

template <typename T, int L>
int launch_rows(const SkinnyGemmParams& p, int splits, peStream_t s) {
  if (p.m <= 1) return launch_typed<T, 1, L>(p, splits, s);
  if (p.m <= 2) return launch_typed<T, 2, L>(p, splits, s);
  if (p.m <= 4) return launch_typed<T, 4, L>(p, splits, s);
  return launch_typed<T, kMaxRows, L>(p, splits, s);
}

template <typename T>
int launch_tile(const SkinnyGemmParams& p, int tile_n, int splits, peStream_t s) {
  return tile_n == 64 ? launch_rows<T, 8>(p, splits, s) : launch_rows<T, 16>(p, splits, s);
}

}  // namespace

int skinny_gemm_tile_n(int n, int num_sms) {
  // Wide tiles (256 contiguous bytes per weight row) where they still give every multiprocessor a block.
  return (n + 127) / 128 >= num_sms ? 128 : 64;
}

int skinny_gemm_split(int k, int n, int tile_n, int num_sms) {
#if defined(PE_CUDA)
  // About one block per multiprocessor (H100, bench_skinny_gemm.py: 1 to 1.5 blocks per SM stream
  // best; more blocks read more rows at once and lose bandwidth), while every thread still gets
  // a run of each range.
  const int tiles = (n + tile_n - 1) / tile_n, runs = k / kRun, groups = kThreads / (tile_n / 8);
  int splits = 1;
  while (splits < kMaxSplit && 10 * tiles * splits < 9 * num_sms && runs / (2 * splits) >= groups) splits *= 2;
  return splits;
#else
  (void)k, (void)n, (void)tile_n, (void)num_sms;
  return 1;
#endif
}

int launch_skinny_gemm(const SkinnyGemmParams& p, void* stream) {
  const int tile_n = p.tile_n == 0 ? skinny_gemm_tile_n(p.n, p.num_sms) : p.tile_n;
  if ((p.dtype != PE_BFLOAT16 && p.dtype != PE_FLOAT16) || p.k % kRun != 0 || p.n % 8 != 0 || p.m < 0 ||
      (tile_n != 64 && tile_n != 128) || p.x_stride % 8 != 0 || !aligned16(p.x) || !aligned16(p.w))
    return -1;
  const int splits = p.split == 0 ? skinny_gemm_split(p.k, p.n, tile_n, p.num_sms) : p.split;
  if (splits != 1 && splits != 2 && splits != 4 && splits != kMaxSplit) return -1;
#if !defined(PE_CUDA)
  if (splits != 1) return -1;  // no clusters: one range per output
#endif
  if (p.m == 0 || p.n == 0) return 0;
  if (p.prefetch_bytes % 16 != 0 || (p.prefetch_bytes > 0 && !aligned16(p.prefetch))) return -1;
  const peStream_t s = static_cast<peStream_t>(stream);
  return p.dtype == PE_BFLOAT16 ? launch_tile<pe_bf16>(p, tile_n, splits, s) : launch_tile<pe_half>(p, tile_n, splits, s);
}
