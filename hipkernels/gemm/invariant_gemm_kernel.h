// The tile kernel of the batch-invariant GEMM (semantics and reduction order in invariant_gemm.h),
// shared by invariant_gemm.hip (one matrix) and grouped_gemm.hip (one weight per group of rows).
// Device code: include from .hip files only.
//
// A block of up to 8 warps owns a BM x BN output tile (BN 32, 64 or 128) and one of `split` K
// ranges; k tiles of 64 stream through a cp.async pipeline of ~96 KB (3 to 16 stages) (x rows
// zero-filled past the block's rows, weight columns past N). Shared tiles are swizzled (16-byte chunk c of row r
// stored at c ^ (r % 8), or c ^ (r / 2 % 4) for 4-chunk rows) so that ldmatrix reads are
// conflict-free: x tiles are [BM][64] (ldmatrix), weight tiles [64][BN] (ldmatrix.trans gives the
// k-major B fragments straight from the [in, out] layout). Each warp computes 16-column-wide (or
// wider) strips: warps 1 x (BN / 16) for BM 16 (decode), 2 x 4 or 4 x 2 for BM 64 and 128. Neither
// BM nor BN enters an output's arithmetic (the k tiles of its range, in order, in one mma chain),
// so the tile is a launch choice from M and the shape (invariant_gemm_tile).
//
// Large M (BM 128) has blocks enough without a split, so there one block walks all K ranges in
// turn (kSequential): its accumulators restart from zero at each range boundary and are added to
// the running total there, in range order - the same fp32 operations, in the same order, as the
// cluster combine, so a row's bits do not depend on which of the two paths its M chose.
//
// Which rows a block computes is the `Rows` policy's answer for blockIdx.y (locate<BM>): the x, w
// and y of its matrix and its first row there. Nothing else of a row's arithmetic depends on it.
#pragma once

#include "gemm/invariant_gemm.h"

#include "common/async_copy.h"
#include "common/hip_compat.h"
#include "common/mma_sync.h"

#if defined(PE_CUDA)
#include <cooperative_groups.h>
#endif

namespace pe_invariant_gemm {

constexpr int kMaxThreads = 256;
constexpr int kBN = 128;  // the widest column tile; invariant_gemm_split counts tiles of this width
constexpr int kBK = 64;
constexpr int kMaxSplit = 8;  // portable cluster size

constexpr int cmin(int a, int b) { return a < b ? a : b; }

struct TileShape {
  int bm, bn;  // rows (16, 64, 128) and columns (32, 64, 128) of a block's output tile
};

template <int BM, int BN>
struct Tile {
  static_assert(BN == 32 || BN == 64 || BN == 128, "column tiles of 32, 64 or 128");
  static constexpr int kWarps = cmin(8, BM / 16 * (BN / 16));   // warp tiles of at least 16 x 16
  static constexpr int kWarpsN = cmin(BN / 16, BM >= 64 ? 4 : 8);
  static constexpr int kWarpsM = kWarps / kWarpsN;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kWarpM = BM / kWarpsM;   // rows per warp: 16, 32 or 64
  static constexpr int kWarpN = BN / kWarpsN;   // columns per warp: 16 or 32
  static constexpr int kMT = kWarpM / 16;       // m16 fragments per warp
  static constexpr int kNT = kWarpN / 8;        // n8 fragments per warp (even: ldmatrix.x4 pairs)
  static constexpr int kAccs = kMT * kNT * 4;   // fp32 accumulators per thread
  static constexpr int kStageElems = BM * kBK + kBK * BN;
  // ~96 KB of tiles in flight, so that two blocks fit an SM (under PDL the next launch's blocks
  // start streaming beside this one's): 5 stages at 16 x 128, 9 at 16 x 64, 16 at 16 x 32
  static constexpr int kStages = cmin(16, 98304 / (kStageElems * 2));
  static constexpr size_t kPipeBytes = (size_t)kStages * kStageElems * 2;
  static constexpr size_t kReduceBytes = (size_t)kAccs * kThreads * 4;
  static constexpr size_t kSmemBytes = kPipeBytes > kReduceBytes ? kPipeBytes : kReduceBytes;
  static_assert(kWarpsM * kWarpsN == kWarps && kNT % 2 == 0 && kStages >= 3, "tile shape");
  static_assert(kBK * BN / 8 % kThreads == 0, "whole weight-tile loads per thread");
};

// The matrix one block works on: rows [m0, m0 + BM) of x [m, K] @ w [K, N] -> y [m, N] (rows
// x_stride / y_stride elements apart). m0 >= m: the block has no rows and leaves.
struct BlockRows {
  const uint16_t* x;
  const uint16_t* w;
  uint16_t* y;
  int m0, m;
};

// One matrix: p.x, p.w, p.y, rows tile * BM on.
struct DenseRows {
  static constexpr bool kReadsStepData = false;  // locate reads nothing a kernel of the step writes
  static constexpr bool kAllTiles = true;        // 32- and 64-column tiles too (blocks under 256 threads)

  unsigned tiles(const InvariantGemmParams& p, int bm) const { return (unsigned)((p.m + bm - 1) / bm); }

  template <int BM>
  PE_DEVICE BlockRows locate(const InvariantGemmParams& p, int tile) const {
    return {static_cast<const uint16_t*>(p.x), static_cast<const uint16_t*>(p.w), static_cast<uint16_t*>(p.y),
            tile * BM, p.m};
  }
};

// Chunk c of row r of a shared tile whose rows hold `kChunks` 16-byte chunks: the 8 rows that one
// ldmatrix reads land in 8 different bank groups.
template <int kChunks>
PE_DEVICE int swizzle(int row, int chunk) {
  return kChunks >= 8 ? chunk ^ (row & 7) : chunk ^ (row >> 1 & 3);
}

template <typename T, int BM, int BN, bool kSequential, typename Rows>
__global__ void __launch_bounds__((Tile<BM, BN>::kThreads))
    invariant_gemm_kernel(InvariantGemmParams p, Rows rows, int splits) {
  using L = Tile<BM, BN>;
  constexpr int kStages = L::kStages, kThreads = L::kThreads;
  static_assert(Rows::kAllTiles || kThreads == kMaxThreads, "the row lookup may need full blocks");
  extern __shared__ __align__(16) uint16_t smem[];
  // cluster (splits, 1, 1): block rank == split; kSequential: one block for all ranges
  const int blocks_per_tile = kSequential ? 1 : splits;
  const int split = kSequential ? 0 : blockIdx.x % splits;
  const int n0 = blockIdx.x / blocks_per_tile * BN;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int wm0 = warp / L::kWarpsN * L::kWarpM, wn0 = warp % L::kWarpsN * L::kWarpN;
  const int k_tiles = p.k / kBK;
  const auto range_begin = [&](int s) { return (int)((int64_t)k_tiles * s / splits); };
  const int kt_begin = kSequential ? 0 : range_begin(split);
  const int kt_count = (kSequential ? k_tiles : range_begin(split + 1)) - kt_begin;

  // The first stages' weights are requested before the wait: under PDL they stream in while the
  // kernel that writes x still runs (weights are never written by a step) - unless finding the
  // block's rows itself reads what the step wrote (grouped rows' offsets).
  pe_pdl_launch_dependents();
  if constexpr (Rows::kReadsStepData) pe_pdl_wait();
  const BlockRows b = rows.template locate<BM>(p, (int)blockIdx.y);
  if (b.m0 >= b.m) return;  // no rows here; the cluster's other blocks (same blockIdx.y) leave too
  const int m0 = b.m0;
  const auto stage_a = [&](int s) { return smem + s * L::kStageElems; };
  const auto stage_b = [&](int s) { return smem + s * L::kStageElems + BM * kBK; };
  // One k tile into stage s: weight rows [64][BN] (BN / 8 chunks a row), x rows [BM][64] (8 a row).
  const auto load_w = [&](int s, int kt) {
    uint16_t* sb = stage_b(s);
#pragma unroll
    for (int it = 0; it < kBK * BN / 8 / kThreads; ++it) {
      const int i = tid + it * kThreads;
      const int r = i / (BN / 8), c = i % (BN / 8), col = n0 + c * 8;
      const bool valid = col < p.n;
      const uint16_t* src = valid ? b.w + (int64_t)(kt * kBK + r) * p.n + col : b.w;
      pe_copy::copy16_async(sb + r * BN + swizzle<BN / 8>(r, c) * 8, src, valid);
    }
  };
  const auto load_x = [&](int s, int kt) {
    uint16_t* sa = stage_a(s);
#pragma unroll
    for (int it = 0; it < (BM * kBK / 8 + kThreads - 1) / kThreads; ++it) {
      const int i = tid + it * kThreads;
      if (BM * kBK / 8 % kThreads != 0 && i >= BM * kBK / 8) break;
      const int r = i / (kBK / 8), c = i % (kBK / 8), row = m0 + r;
      const bool valid = row < b.m;
      const uint16_t* src = valid ? b.x + (int64_t)row * p.x_stride + kt * kBK + c * 8 : b.x;
      pe_copy::copy16_async(sa + r * kBK + swizzle<8>(r, c) * 8, src, valid);
    }
  };

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s)
    if (s < kt_count) load_w(s, kt_begin + s);
  if constexpr (!Rows::kReadsStepData) pe_pdl_wait();
  // 16-row tiles whose whole range fits the ring (SmolLM2's projections at decode): see below.
  const bool resident = !kSequential && BM == 16 && kt_count <= kStages;
  if (!resident) {
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
      if (s < kt_count) load_x(s, kt_begin + s);
      pe_copy::copy_commit();
    }
  }

  float acc[L::kMT][L::kNT][4];
  float total[kSequential ? L::kMT : 1][kSequential ? L::kNT : 1][4];
  const auto for_each_acc = [&](auto&& f) {
#pragma unroll
    for (int i = 0; i < L::kMT; ++i)
#pragma unroll
      for (int j = 0; j < L::kNT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) f(i, j, e);
  };
  for_each_acc([&](int i, int j, int e) { acc[i][j][e] = 0.f; });
  int range = 0, range_end = kSequential ? range_begin(1) : kt_count;
  // One k tile's products into acc, from its stage in shared memory (both paths below: the same
  // products in the same order).
  const auto mma_tile = [&](const uint16_t* sa, const uint16_t* sb) {
#pragma unroll
    for (int kk = 0; kk < kBK / 16; ++kk) {
      uint32_t a[L::kMT][4];
#pragma unroll
      for (int i = 0; i < L::kMT; ++i) {
        const int r = wm0 + i * 16 + lane % 16;
        pe_mma::ldsm_x4<false>(a[i], sa + r * kBK + swizzle<8>(r, kk * 2 + lane / 16) * 8);
      }
      uint32_t bf[L::kNT][2];
#pragma unroll
      for (int j = 0; j < L::kNT; j += 2) {
        const int r = kk * 16 + lane % 8 + (lane / 8) % 2 * 8;
        uint32_t frag[4];
        pe_mma::ldsm_x4<true>(frag, sb + r * BN + swizzle<BN / 8>(r, (wn0 + j * 8) / 8 + lane / 16) * 8);
        bf[j][0] = frag[0], bf[j][1] = frag[1], bf[j + 1][0] = frag[2], bf[j + 1][1] = frag[3];
      }
#pragma unroll
      for (int i = 0; i < L::kMT; ++i)
#pragma unroll
        for (int j = 0; j < L::kNT; ++j) pe_mma::mma16816<T>(acc[i][j], a[i], bf[j][0], bf[j][1]);
    }
  };

  if (resident) {
    // Every x tile (and the last weight tile) requested, one wait and one barrier, then the mma
    // chain with stage t holding tile t: fixed shared offsets, no ring arithmetic, no barrier
    // between tiles. A decode launch has one warp per scheduler, so its time is its instruction
    // count (ncu, SmolLM2's qkv at M = 16: ~2000 a warp at 3.9 cycles each, against cuBLAS's
    // ~340). The same products in the same order as the ring below.
    if (kt_count == kStages) load_w(kStages - 1, kt_begin + kStages - 1);
#pragma unroll
    for (int s = 0; s < kStages; ++s)
      if (s < kt_count) load_x(s, kt_begin + s);
    pe_copy::copy_commit();
    pe_copy::copy_wait<0>();
    __syncthreads();
#pragma unroll
    for (int t = 0; t < kStages; ++t) {
      if (t >= kt_count) break;
      mma_tile(stage_a(t), stage_b(t));
    }
  }
  for (int t = 0; t < (resident ? 0 : kt_count); ++t) {
    if constexpr (kSequential) {
      while (t == range_end) {  // range `range` is complete (an empty one too): into the total, in order
        if (range == 0)
          for_each_acc([&](int i, int j, int e) { total[i][j][e] = acc[i][j][e], acc[i][j][e] = 0.f; });
        else
          for_each_acc([&](int i, int j, int e) { total[i][j][e] += acc[i][j][e], acc[i][j][e] = 0.f; });
        range_end = range_begin(++range + 1);
      }
    }
    pe_copy::copy_wait<kStages - 2>();
    __syncthreads();  // tile t landed for every thread; stage (t - 1) % kStages is free again
    const int next = t + kStages - 1;
    if (next < kt_count) {
      load_w(next % kStages, kt_begin + next);
      load_x(next % kStages, kt_begin + next);
    }
    pe_copy::copy_commit();
    mma_tile(stage_a(t % kStages), stage_b(t % kStages));
  }
  pe_copy::copy_wait<0>();
  __syncthreads();  // the pipeline's shared memory becomes the ranges' exchange buffer
  if constexpr (kSequential) {
    if (range > 0) for_each_acc([&](int i, int j, int e) { acc[i][j][e] = total[i][j][e] + acc[i][j][e]; });
  }

  // K ranges in increasing order, bias last, one rounding. With a split every block publishes its
  // partial sums and block `split` finishes the accumulator pairs (two adjacent columns, stored
  // together) a / 2 with a / 2 % splits == split, written a / 2 & (splits - 1) (splits is 1, 2, 4
  // or 8): a modulo by the run-time splits made every unrolled check a division, and the combine
  // and stores then took ~48% of a 64 x 128 block's sampled time (ncu, Llama-8B's o at M = 64).
  // Which block finishes a pair never changes its sum.
  float* part = reinterpret_cast<float*>(smem);
#if defined(PE_CUDA)
  cooperative_groups::cluster_group cluster = cooperative_groups::this_cluster();
  if (!kSequential && splits > 1) {
#pragma unroll
    for (int i = 0; i < L::kMT; ++i)
#pragma unroll
      for (int j = 0; j < L::kNT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) part[((i * L::kNT + j) * 4 + e) * kThreads + tid] = acc[i][j][e];
    cluster.sync();
    // Rank by rank (in order), all of a rank's accumulators at once, so that the remote loads
    // overlap: the same additions, (rank 0 + rank 1) + rank 2 ..., as one chain per accumulator.
    for (int r = 0; r < splits; ++r) {
      const float* remote = cluster.map_shared_rank(part, r);
#pragma unroll
      for (int i = 0; i < L::kMT; ++i)
#pragma unroll
        for (int j = 0; j < L::kNT; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int a = (i * L::kNT + j) * 4 + e;
            if ((a / 2 & (splits - 1)) != split) continue;
            const float v = remote[a * kThreads + tid];
            acc[i][j][e] = r == 0 ? v : acc[i][j][e] + v;
          }
    }
  }
#endif
  const uint16_t* bias = static_cast<const uint16_t*>(p.bias);
#pragma unroll
  for (int i = 0; i < L::kMT; ++i)
#pragma unroll
    for (int j = 0; j < L::kNT; ++j) {
      const int col = n0 + wn0 + j * 8 + lane % 4 * 2;
      if (col >= p.n) continue;  // N % 8 == 0: col + 1 < N as well
      const float b0 = bias ? PeVec8<T>::element_to_float(bias[col]) : 0.f;
      const float b1 = bias ? PeVec8<T>::element_to_float(bias[col + 1]) : 0.f;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = m0 + wm0 + i * 16 + lane / 4 + h * 8;
        const int a = (i * L::kNT + j) * 4 + h * 2;
        if (row >= b.m || (!kSequential && splits > 1 && (a / 2 & (splits - 1)) != split)) continue;
        const uint32_t lo = PeVec8<T>::from_float(acc[i][j][h * 2] + b0);
        const uint32_t hi = PeVec8<T>::from_float(acc[i][j][h * 2 + 1] + b1);
        *reinterpret_cast<uint32_t*>(b.y + (int64_t)row * p.y_stride + col) = lo | (hi << 16);
      }
    }
#if defined(PE_CUDA)
  // No block leaves while another still reads its shared memory.
  if (!kSequential && splits > 1) cluster.sync();
#endif
}

inline bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

// Shape checks common to every launch: dtype, K a multiple of 64, N of 8, 16-byte x and w rows.
inline bool takes_shape(const InvariantGemmParams& p) {
  return (p.dtype == PE_BFLOAT16 || p.dtype == PE_FLOAT16) && p.k > 0 && p.k % kBK == 0 && p.n % 8 == 0 && p.m >= 0 &&
         p.x_stride % 8 == 0 && p.y_stride % 2 == 0 && aligned16(p.x) && aligned16(p.w);
}

template <typename T, int BM, int BN, bool kSequential, typename Rows>
int launch_tiles(const InvariantGemmParams& p, const Rows& rows, int splits, peStream_t s) {
#if defined(PE_CUDA)
  using L = Tile<BM, BN>;
  const auto kernel = invariant_gemm_kernel<T, BM, BN, kSequential, Rows>;
  static const cudaError_t attr_rc =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)L::kSmemBytes);
  if (attr_rc != cudaSuccess) return (int)attr_rc;
  const unsigned tiles = rows.tiles(p, BM);
  if (tiles > 65535u) return -1;  // gridDim.y
  if (tiles == 0) return 0;
  cudaLaunchConfig_t cfg = {};
  const int blocks_per_tile = kSequential ? 1 : splits;
  cfg.gridDim = dim3((unsigned)((p.n + BN - 1) / BN * blocks_per_tile), tiles);
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
  const cudaError_t rc = cudaLaunchKernelEx(&cfg, kernel, p, rows, splits);
  return rc != cudaSuccess ? (int)rc : (int)peGetLastError();
#else
  (void)p, (void)rows, (void)splits, (void)s;
  return -1;
#endif
}

constexpr int kMinRangeTiles = 6;  // invariant_gemm_split: k tiles a K range keeps at least

// The output tile from the rows a matrix is expected to have and the shape (neither tile side is
// ever part of a row's arithmetic, only of the launch's efficiency). Decode-sized launches are
// latency-bound and a block streams its weights at a bounded rate, so blocks should be many, but
// each block re-reads its rows of x and each row tile the weights. Where 128-column tiles give
// fewer blocks than half the SMs (SmolLM2's projections), up to narrow_rows rows: the first of
// 16 x 64, 64 x 32 and 64 x 64 that makes at most two blocks per SM (else 64 x 128). Else 16 x 128
// up to 16 rows, 64 x 128 up to 256 (fewer re-reads of the weights from L2), then 128 x 128
// walking K in turn. narrow_rows: 256, or kInvariantGemmNarrowRows for one dense matrix (the rows of
// SmolLM2's verify steps at batch 64 and prompt chunks up to 768 tokens, whose narrow projections
// run there ~1.3-1.8x faster than on wgmma or 128 x 128 tiles). H100: docs/kernels/invariant_gemm.md.
inline TileShape invariant_gemm_tile(int rows, int n, int splits, int num_sms, int narrow_rows = 256) {
  const auto blocks = [&](TileShape t) {
    return (int64_t)((rows + t.bm - 1) / t.bm) * ((n + t.bn - 1) / t.bn) * splits;
  };
  static_assert(kBN == 128, "invariant_gemm_narrow counts 128-column tiles");
  if (invariant_gemm_narrow(n, splits, num_sms) && rows <= narrow_rows) {
    for (const TileShape t : {TileShape{16, 64}, TileShape{64, 32}, TileShape{64, 64}})
      if (blocks(t) <= 2 * num_sms) return t;
    return {64, kBN};
  }
  if (rows <= 16) return {16, kBN};
  if (rows <= 256) return {64, kBN};
  return {128, kBN};
}

template <typename T, typename Rows>
int launch_rows(const InvariantGemmParams& p, const Rows& rows, int rows_per_matrix, int splits, peStream_t s) {
  TileShape t = invariant_gemm_tile(rows_per_matrix, p.n, splits, p.num_sms, Rows::kAllTiles ? kInvariantGemmNarrowRows : 256);
  if (p.tile_m != 0) t.bm = p.tile_m;  // benchmarks and tests: any tile gives the same bits
  if (p.tile_n != 0) t.bn = p.tile_n;
  if constexpr (!Rows::kAllTiles) t.bn = kBN;  // grouped rows: 128-column tiles
  if constexpr (Rows::kAllTiles) {
    if (t.bm == 16 && t.bn == 64) return launch_tiles<T, 16, 64, false>(p, rows, splits, s);
    if (t.bm == 16 && t.bn == 32) return launch_tiles<T, 16, 32, false>(p, rows, splits, s);
    if (t.bm == 64 && t.bn == 64) return launch_tiles<T, 64, 64, false>(p, rows, splits, s);
    if (t.bm == 64 && t.bn == 32) return launch_tiles<T, 64, 32, false>(p, rows, splits, s);
  }
  if (t.bn != kBN) return -1;
  if (t.bm == 16) return launch_tiles<T, 16, kBN, false>(p, rows, splits, s);
  if (t.bm == 64) return launch_tiles<T, 64, kBN, false>(p, rows, splits, s);
  if (t.bm == 128)
    return splits > 1 ? launch_tiles<T, 128, kBN, true>(p, rows, splits, s)
                      : launch_tiles<T, 128, kBN, false>(p, rows, splits, s);
  return -1;
}

// Dispatch on the dtype (the caller has checked takes_shape and the split).
template <typename Rows>
int launch_typed(const InvariantGemmParams& p, const Rows& rows, int rows_per_matrix, int splits, void* stream) {
  const peStream_t s = static_cast<peStream_t>(stream);
  return p.dtype == PE_BFLOAT16 ? launch_rows<pe_bf16>(p, rows, rows_per_matrix, splits, s)
                                : launch_rows<pe_half>(p, rows, rows_per_matrix, splits, s);
}

}  // namespace pe_invariant_gemm
