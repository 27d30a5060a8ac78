// Batch-invariant grouped GEMM (semantics in grouped_gemm.h): the invariant GEMM's tile kernel
// (invariant_gemm_kernel.h) with a row lookup per group form. A block's blockIdx.y names a row tile
// of one group; the lookup gives the group's x, w and y and the tile's first row, and the kernel
// computes exactly what invariant_gemm computes for those rows.
#include "gemm/grouped_gemm.h"

#include <algorithm>

#include "gemm/invariant_gemm_kernel.h"

using namespace pe_invariant_gemm;

namespace {

PE_DEVICE int clamp_rows(int v, int m) { return v < 0 ? 0 : v > m ? m : v; }

// Equal groups: group g's m rows at g * (x / y)_group_stride; row tiles group after group.
struct EqualGroupRows {
  static constexpr bool kReadsStepData = false;
  static constexpr bool kAllTiles = false;  // 128-column tiles only
  int num_groups;
  int64_t x_group_stride, y_group_stride, w_group_stride;

  unsigned tiles(const InvariantGemmParams& p, int bm) const {
    return (unsigned)std::min<int64_t>((int64_t)num_groups * ((p.m + bm - 1) / bm), 1 << 20);
  }

  template <int BM>
  PE_DEVICE BlockRows locate(const InvariantGemmParams& p, int tile) const {
    const int per_group = (p.m + BM - 1) / BM, g = tile / per_group;
    return {static_cast<const uint16_t*>(p.x) + g * x_group_stride, static_cast<const uint16_t*>(p.w) + g * w_group_stride,
            static_cast<uint16_t*>(p.y) + g * y_group_stride, tile % per_group * BM, p.m};
  }
};

// Groups by cumulative counts on the device (rows sorted by group). Row tiles are numbered group
// after group, ceil(rows_g / BM) for group g; a block finds its group by a prefix sum of those
// counts over the groups, kMaxThreads groups at a time. Tiles past the last group's return.
struct OffsetGroupRows {
  static constexpr bool kReadsStepData = true;  // offs is written by the step (the router's counts)
  static constexpr bool kAllTiles = false;   // locate's scan takes a full block of kMaxThreads
  const int32_t* offs;
  int num_groups;
  int64_t w_group_stride;

  // Worst case: every row tile full but one partial tile per non-empty group (at most min(G, m)).
  unsigned tiles(const InvariantGemmParams& p, int bm) const {
    return (unsigned)std::min<int64_t>((p.m + bm - 1) / bm + std::min(num_groups, p.m), 1 << 20);
  }

  template <int BM>
  PE_DEVICE BlockRows locate(const InvariantGemmParams& p, int tile) const {
    __shared__ int scan[kMaxThreads];
    __shared__ int hit[4];  // group, its first row, its rows, the tile's index inside it
    const int tid = threadIdx.x;
    if (tid == 0) hit[0] = -1;
    __syncthreads();
    int before = 0;  // row tiles of the groups of earlier chunks
    for (int g0 = 0; g0 < num_groups; g0 += kMaxThreads) {
      const int g = g0 + tid;
      int begin = 0, rows = 0;
      if (g < num_groups) {  // clamped to x's rows: malformed offsets read nothing outside x
        begin = clamp_rows(g == 0 ? 0 : offs[g - 1], p.m);
        rows = clamp_rows(offs[g], p.m) - begin;
      }
      const int tiles = rows > 0 ? (rows + BM - 1) / BM : 0;
      scan[tid] = tiles;
      __syncthreads();
      for (int o = 1; o < kMaxThreads; o *= 2) {  // inclusive prefix sum over the chunk
        const int v = tid >= o ? scan[tid - o] : 0;
        __syncthreads();
        scan[tid] += v;
        __syncthreads();
      }
      const int first = before + scan[tid] - tiles;  // this group's first tile
      if (tiles > 0 && tile >= first && tile < first + tiles) {
        hit[0] = g, hit[1] = begin, hit[2] = rows, hit[3] = tile - first;
      }
      before += scan[kMaxThreads - 1];
      __syncthreads();  // hit visible to all; scan free for the next chunk
      if (hit[0] >= 0 || before > tile) break;
    }
    const uint16_t* x = static_cast<const uint16_t*>(p.x);
    const uint16_t* w = static_cast<const uint16_t*>(p.w);
    uint16_t* y = static_cast<uint16_t*>(p.y);
    if (hit[0] < 0) return {x, w, y, 0, 0};
    return {x + (int64_t)hit[1] * p.x_stride, w + hit[0] * w_group_stride, y + (int64_t)hit[1] * p.y_stride,
            hit[3] * BM, hit[2]};
  }
};

}  // namespace

int launch_grouped_gemm(const GroupedGemmParams& g, void* stream) {
  InvariantGemmParams p;
  p.x = g.x, p.w = g.w, p.y = g.y, p.m = g.m, p.n = g.n, p.k = g.k, p.x_stride = g.x_stride, p.y_stride = g.y_stride;
  p.dtype = g.dtype, p.num_sms = g.num_sms, p.split = g.split, p.pdl = g.pdl;
  if (!takes_shape(p) || g.num_groups < 1 || g.x_group_stride % 8 != 0 || g.y_group_stride % 2 != 0 ||
      reinterpret_cast<uintptr_t>(g.y) % 4 != 0)
    return -1;
  const int splits = p.split == 0 ? invariant_gemm_split(p.k, p.n, p.num_sms) : p.split;
  if (splits != 1 && splits != 2 && splits != 4 && splits != kMaxSplit) return -1;
  if (p.m == 0 || p.n == 0) return 0;
  const int64_t w_group_stride = (int64_t)p.k * p.n;
  if (g.offs == nullptr)
    return launch_typed(p, EqualGroupRows{g.num_groups, g.x_group_stride, g.y_group_stride, w_group_stride}, p.m,
                        splits, stream);
  // The row tile from the rows an average group would have: no count is read on the host.
  const int spread = std::min(g.num_groups, p.m);
  return launch_typed(p, OffsetGroupRows{g.offs, g.num_groups, w_group_stride}, (p.m + spread - 1) / spread, splits,
                      stream);
}
