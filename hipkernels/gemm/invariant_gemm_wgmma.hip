// Batch-invariant GEMM, wgmma family (contract and reduction order in invariant_gemm_wgmma.h).
//
// A block owns a BM x 128 output tile (BM 64: one consumer warpgroup, for M <= 64; BM 128: two)
// and one K range (cluster launch) or all of them in turn. Its last warp is the producer: one lane
// streams k tiles of 64 through a kStages-deep ring of shared-memory stages with TMA, x as one
// [BM][64] box and the weight as two [64 k][64 n] boxes, all 128-byte swizzled (the layout of
// common/wgmma_tile.h, which the tensor cores read directly: no fence.proxy.async, since TMA writes
// through the async proxy). Each stage has a full barrier (transaction bytes) and an empty one (one
// arrival per consumer warp). Consumers issue four m64n128k16 products per k tile and keep one
// tile's products in flight (wait_group 1) before releasing the previous stage.
#include "gemm/invariant_gemm_wgmma.h"

#include "common/hip_compat.h"

#if defined(PE_CUDA)
#include <cooperative_groups.h>
#include <cuda.h>

#include "common/wgmma_tile.h"
#include "gemm/tma.h"

namespace {

constexpr int kBN = 128, kBK = 64, kGroupM = 16;

template <int BM>
struct WgTile {
  static constexpr int kConsumers = BM / 64 * 128;  // threads of the consumer warpgroups
  static constexpr int kThreads = kConsumers + 32;  // and one producer warp
  // BM 64 (decode, weight-bound): 4 stages, ~97 KB, two blocks per SM (one's prologue and combine
  // overlap the other's stream); BM 128: 6 stages, one block per SM.
  static constexpr int kStages = BM == 64 ? 4 : 6;
  static constexpr int kABytes = BM * kBK * 2, kBBytes = kBK * kBN * 2, kStageBytes = kABytes + kBBytes;
  static constexpr size_t kSmemBytes = 1024 + (size_t)kStages * kStageBytes + 2 * kStages * sizeof(uint64_t);
  static_assert((size_t)kConsumers * 64 * 4 <= (size_t)kStages * kStageBytes, "exchange buffer fits the stages");
  static_assert(BM != 64 || 2 * (kSmemBytes + 1024) <= 228 * 1024, "two decode blocks per SM");
};

#if defined(PE_WGMMA)
#define PE_WG_REGS64 \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define PE_WG_OUTS64(d) PE_WG_OUTS32(d), PE_WG_OUTS32((d + 32))

// acc (64 x 128, wgmma layout) += A (the warpgroup's 64 rows, k 16 kk..) * B (k rows 16 kk.., 128 n).
template <typename T>
PE_DEVICE void product(float* acc, const uint8_t* a, const uint8_t* b, int kk) {
  const uint64_t da = pe_wg::desc(a + kk * 32, 16, 1024);
  const uint64_t db = pe_wg::desc(b + kk * 16 * 128, kBK * 128, 1024);  // MN-major: slabs 8 KB apart
  if constexpr (std::is_same<T, pe_bf16>::value)
    PE_WGMMA_ASM("m64n128k16.f32.bf16.bf16", PE_WG_REGS64, "64", "65", "66", "1", PE_WG_OUTS64(acc));
  else
    PE_WGMMA_ASM("m64n128k16.f32.f16.f16", PE_WG_REGS64, "64", "65", "66", "1", PE_WG_OUTS64(acc));
}
#endif

template <typename T, int BM, bool kSequential>
__global__ void __launch_bounds__(WgTile<BM>::kThreads, BM == 64 ? 2 : 1)
    wgmma_gemm_kernel(const __grid_constant__ CUtensorMap map_x, const __grid_constant__ CUtensorMap map_w,
                      InvariantGemmParams p, int splits) {
#if defined(PE_WGMMA) && defined(PE_TMA)
  using L = WgTile<BM>;
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  uint8_t* smem = smem_raw + pe_wg::align_1024(smem_raw);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + L::kStages * L::kStageBytes);
  uint64_t* empty = full + L::kStages;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  // cluster (splits, 1, 1): block rank == split; kSequential: one block walks every range
  const int split = kSequential ? 0 : (int)(blockIdx.x % splits);
  const int tile = (int)(blockIdx.x / (kSequential ? 1 : splits));
  // Tiles in groups of kGroupM row tiles, columns within a group (L2 reuse of x and w across a wave).
  const int tiles_m = (p.m + BM - 1) / BM, tiles_n = (p.n + kBN - 1) / kBN;
  const int first_m = tile / (kGroupM * tiles_n) * kGroupM, in_group = tile % (kGroupM * tiles_n);
  const int group_rows = min(tiles_m - first_m, kGroupM);
  const int m0 = (first_m + in_group % group_rows) * BM, n0 = in_group / group_rows * kBN;
  const int k_tiles = p.k / kBK;
  const auto range_begin = [&](int s) { return (int)((int64_t)k_tiles * s / splits); };
  const int kt_begin = kSequential ? 0 : range_begin(split);
  const int kt_count = (kSequential ? k_tiles : range_begin(split + 1)) - kt_begin;

  if (tid == 0) {
    for (int s = 0; s < L::kStages; ++s) pe_tma::init(&full[s], 1), pe_tma::init(&empty[s], L::kConsumers / 32);
    pe_tma::fence_init();
  }
  __syncthreads();
  pe_pdl_launch_dependents();

  float acc[64];
  float total[kSequential ? 64 : 1];
  int range = 0;
  if (warp == L::kConsumers / 32) {
    if (lane == 0) {  // producer: the first stages' weights before the PDL wait (no kernel of a step writes them)
      pe_tma::prefetch_map(&map_x), pe_tma::prefetch_map(&map_w);
      const auto load_w = [&](int t) {
        uint8_t* st = smem + (t % L::kStages) * L::kStageBytes + L::kABytes;
        pe_tma::load_2d(st, &map_w, &full[t % L::kStages], n0, (kt_begin + t) * kBK);
        pe_tma::load_2d(st + kBK * 128, &map_w, &full[t % L::kStages], n0 + 64, (kt_begin + t) * kBK);
      };
      const auto load_x = [&](int t) {
        pe_tma::load_2d(smem + (t % L::kStages) * L::kStageBytes, &map_x, &full[t % L::kStages],
                        (kt_begin + t) * kBK, m0);
      };
      const int first = min(kt_count, L::kStages);
      for (int t = 0; t < first; ++t) pe_tma::arrive_expect_tx(&full[t], L::kStageBytes), load_w(t);
      pe_pdl_wait();
      for (int t = 0; t < first; ++t) load_x(t);
      for (int t = first; t < kt_count; ++t) {
        pe_tma::wait(&empty[t % L::kStages], (t / L::kStages - 1) & 1);
        pe_tma::arrive_expect_tx(&full[t % L::kStages], L::kStageBytes);
        load_w(t), load_x(t);
      }
    }
    __syncwarp();
  } else {
    const uint8_t* a_rows = smem + (warp / 4) * 64 * 128;  // this warpgroup's 64 rows of each x stage
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[i] = 0.f;
    int range_end = kSequential ? range_begin(1) : kt_count;
    for (int t = 0; t < kt_count; ++t) {
      if constexpr (kSequential) {
        while (t == range_end) {  // range `range` complete (empty ranges too): into the total, in order
          pe_tma::wgmma_wait<0>();
          pe_wg::fence_operands(acc);
#pragma unroll
          for (int i = 0; i < 64; ++i) total[i] = range == 0 ? acc[i] : total[i] + acc[i], acc[i] = 0.f;
          range_end = range_begin(++range + 1);
        }
      }
      const int s = t % L::kStages;
      pe_tma::wait(&full[s], (t / L::kStages) & 1);
      pe_wg::fence_operands(acc);
      pe_wg::begin();
#pragma unroll
      for (int kk = 0; kk < kBK / 16; ++kk) product<T>(acc, a_rows + s * L::kStageBytes, smem + s * L::kStageBytes + L::kABytes, kk);
      pe_wg::commit();
      pe_tma::wgmma_wait<1>();  // the previous tile's products are done: its stage is free
      pe_wg::fence_operands(acc);
      if (t > 0 && lane == 0) pe_tma::arrive(&empty[(t - 1) % L::kStages]);
    }
    pe_tma::wgmma_wait<0>();
    pe_wg::fence_operands(acc);
    if constexpr (kSequential) {
      if (range > 0) {
#pragma unroll
        for (int i = 0; i < 64; ++i) acc[i] = total[i] + acc[i];
      }
    }
  }

  // K ranges in increasing order, bias last, one rounding. With a split every block publishes its
  // partial sums and block `split` finishes the column pairs a / 2 with a / 2 % splits == split
  // (written with the mask splits - 1: a modulo by the run-time splits made each unrolled check a
  // division, ~8 us of Llama-8B's down at M = 64 under ncu).
  const bool consumer = warp < L::kConsumers / 32;
  if (consumer) pe_pdl_wait();  // y may be read by the previous kernel (an empty K range loads nothing)
  const bool clustered = !kSequential && splits > 1;
  cooperative_groups::cluster_group cluster = cooperative_groups::this_cluster();
  if (clustered) {
    float2* part = reinterpret_cast<float2*>(smem);  // [column pair][consumer thread]
    if (consumer) {
      pe_tma::named_sync(1, L::kConsumers);  // every warpgroup's products have read the stages
#pragma unroll
      for (int c = 0; c < 32; ++c) part[c * L::kConsumers + tid] = make_float2(acc[2 * c], acc[2 * c + 1]);
    }
    cluster.sync();
    if (consumer) {
      // Rank by rank (in order), all of a rank's pairs at once: the remote loads overlap.
      for (int r = 0; r < splits; ++r) {
        const float2* remote = cluster.map_shared_rank(part, r);
#pragma unroll
        for (int c = 0; c < 32; ++c) {
          if ((c & (splits - 1)) != split) continue;  // c % splits (1, 2, 4 or 8) without a division
          const float2 v = remote[c * L::kConsumers + tid];
          acc[2 * c] = r == 0 ? v.x : acc[2 * c] + v.x;
          acc[2 * c + 1] = r == 0 ? v.y : acc[2 * c + 1] + v.y;
        }
      }
    }
  }
  if (consumer) {
    const uint16_t* bias = static_cast<const uint16_t*>(p.bias);
    uint16_t* y = static_cast<uint16_t*>(p.y);
    const int row0 = m0 + (warp / 4) * 64 + (warp % 4) * 16 + lane / 4;
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const int col = n0 + 8 * i + lane % 4 * 2;
      if (col >= p.n) continue;  // N % 8 == 0: col + 1 < N as well
      const float b0 = bias ? PeVec8<T>::element_to_float(bias[col]) : 0.f;
      const float b1 = bias ? PeVec8<T>::element_to_float(bias[col + 1]) : 0.f;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = row0 + 8 * h, a = 4 * i + 2 * h;
        if (row >= p.m || (clustered && (a / 2 & (splits - 1)) != split)) continue;
        const uint32_t lo = PeVec8<T>::from_float(acc[a] + b0), hi = PeVec8<T>::from_float(acc[a + 1] + b1);
        *reinterpret_cast<uint32_t*>(y + (int64_t)row * p.y_stride + col) = lo | (hi << 16);
      }
    }
  }
  if (clustered) cluster.sync();  // no block leaves while another still reads its shared memory
#else
  (void)map_x, (void)map_w, (void)p, (void)splits;
#endif
}

template <typename T, int BM, bool kSequential>
int launch(const InvariantGemmParams& p, int splits, cudaStream_t s) {
  using L = WgTile<BM>;
  const auto kernel = wgmma_gemm_kernel<T, BM, kSequential>;
  static const cudaError_t attr_rc =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)L::kSmemBytes);
  if (attr_rc != cudaSuccess) return (int)attr_rc;
  CUtensorMap map_x, map_w;
  if (!pe_tma::encode(&map_x, p.dtype, p.x, (uint64_t)p.k, (uint64_t)p.m, p.x_stride, BM) ||
      !pe_tma::encode(&map_w, p.dtype, p.w, (uint64_t)p.n, (uint64_t)p.k, p.n, kBK))
    return -1;
  const int64_t tiles = (int64_t)((p.m + BM - 1) / BM) * ((p.n + kBN - 1) / kBN) * (kSequential ? 1 : splits);
  if (tiles > 0x7fffffff) return -1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3((unsigned)tiles);
  cfg.blockDim = dim3(L::kThreads);
  cfg.dynamicSmemBytes = L::kSmemBytes;
  cfg.stream = s;
  cudaLaunchAttribute attrs[2];
  unsigned n = 0;
  if (!kSequential && splits > 1) {
    attrs[n].id = cudaLaunchAttributeClusterDimension;
    attrs[n].val.clusterDim.x = (unsigned)splits;
    attrs[n].val.clusterDim.y = 1;
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
  const cudaError_t rc = cudaLaunchKernelEx(&cfg, kernel, map_x, map_w, p, splits);
  return rc != cudaSuccess ? (int)rc : (int)cudaGetLastError();
}

// The row tile and the combine from M (a launch's efficiency only, never a row's arithmetic): 64
// rows for decode; 128 above, the ranges in a cluster while the tiles are fewer than a wave; 128 x
// 256 or 192 (invariant_gemm_wgmma_wide.hip) where invariant_gemm_wgmma_wide_for says. family 2
// with tile_n 128 / 192 / 256 forces the width (tests, benchmarks; 256 needs split 1).
template <typename T>
int launch_rows(const InvariantGemmParams& p, int splits, cudaStream_t s) {
  const bool forced = p.family == 2 && p.tile_n != 0;
  const int wide = forced ? (p.tile_n == kBN ? 0 : p.tile_n) : invariant_gemm_wgmma_wide_for(p, splits);
  if (wide != 0) return launch_invariant_gemm_wgmma_wide(p, splits, wide, s);
  if (p.m <= 64) return launch<T, 64, false>(p, splits, s);
  const int64_t tiles = (int64_t)((p.m + 127) / 128) * ((p.n + kBN - 1) / kBN);
  if (splits > 1 && tiles < p.num_sms) return launch<T, 128, false>(p, splits, s);
  return splits > 1 ? launch<T, 128, true>(p, splits, s) : launch<T, 128, false>(p, splits, s);
}

}  // namespace

bool invariant_gemm_wgmma_available() { return pe_tma::encoder() != nullptr; }

int launch_invariant_gemm_wgmma(const InvariantGemmParams& p, int splits, void* stream) {
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  return p.dtype == PE_BFLOAT16 ? launch_rows<pe_bf16>(p, splits, s) : launch_rows<pe_half>(p, splits, s);
}

#else  // not CUDA: the mma.sync family (or nothing) serves every launch

bool invariant_gemm_wgmma_available() { return false; }

int launch_invariant_gemm_wgmma(const InvariantGemmParams&, int, void*) { return -1; }

#endif
