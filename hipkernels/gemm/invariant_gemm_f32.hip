// Batch-invariant fp32 GEMM (semantics and reduction order in invariant_gemm_f32.h).
//
// A block of 256 threads (16 x 16) owns a BM x 64 output tile: BM 16 (decode: 1 x 4 outputs per
// thread) or 64 (4 x 4), thread (ty, tx) holding rows ty + 16 i and columns tx + 16 j, so that a
// warp's shared-memory reads are broadcasts or consecutive words. k tiles of 32 pass through shared
// memory: x transposed [32][BM + 1] (the padding keeps the transposing stores free of bank
// conflicts), weights [32][64] as they lie in memory; the next tile of a range is read into
// registers while the current one is multiplied. Every global read is a scalar read with a bounds
// check (zeros past M, N and K), so any shape, stride and alignment is taken.
//
// Few output tiles (decode): block z of a tile walks K range z alone and writes its partial sums to
// the workspace [split][M][N]; a second kernel adds them in range order, bias last. Many output
// tiles (prefill): one block walks every range in turn, its accumulators restarting from zero at
// each range boundary and added to the running total there - the same fp32 operations in the same
// order, so which of the two a row's M picked never shows in its bits.
#include "gemm/invariant_gemm_f32.h"

#include "common/hip_compat.h"

namespace {

constexpr int kThreads = 256;  // 16 x 16
constexpr int kBN = 64;
constexpr int kBK = 32;
constexpr int kTN = kBN / 16;  // columns per thread
constexpr int kMaxSplit = 8;

int k_tiles_of(int k) { return (k + kBK - 1) / kBK; }
int n_tiles_of(int n) { return (n + kBN - 1) / kBN; }
int rows_per_tile(int m) { return m <= 16 ? 16 : 64; }
int64_t m_tiles_of(int m) { return (m + rows_per_tile(m) - 1) / rows_per_tile(m); }

// The first k tile of range s of `splits` (ranges of whole tiles, sizes differing by at most one).
PE_DEVICE int range_begin(int k_tiles, int s, int splits) { return (int)((int64_t)k_tiles * s / splits); }

template <int TM>
__global__ void __launch_bounds__(kThreads) invariant_gemm_f32_kernel(InvariantGemmF32Params p, int splits,
                                                                      bool to_workspace) {
  constexpr int BM = 16 * TM;
  constexpr int kXLoads = BM * kBK / kThreads;   // 2 or 8 x values per thread and tile
  constexpr int kWLoads = kBK * kBN / kThreads;  // 8 weights per thread and tile
  __shared__ float xs[kBK][BM + 1];
  __shared__ float ws[kBK][kBN];
  const int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
  const int n0 = blockIdx.x * kBN, m0 = blockIdx.y * BM;
  const int k_tiles = (p.k + kBK - 1) / kBK;
  const int r_first = to_workspace ? (int)blockIdx.z : 0;
  const int r_last = to_workspace ? (int)blockIdx.z + 1 : splits;

  float xr[kXLoads], wr[kWLoads];
  const auto load = [&](int kt) {  // tile kt into registers (coalesced: consecutive threads, consecutive k / n)
    const int k0 = kt * kBK;
#pragma unroll
    for (int i = 0; i < kXLoads; ++i) {
      const int e = tid + i * kThreads, row = m0 + e / kBK, kk = k0 + e % kBK;
      xr[i] = row < p.m && kk < p.k ? p.x[(int64_t)row * p.x_stride + kk] : 0.f;
    }
#pragma unroll
    for (int i = 0; i < kWLoads; ++i) {
      const int e = tid + i * kThreads, kk = k0 + e / kBN, col = n0 + e % kBN;
      wr[i] = kk < p.k && col < p.n ? p.w[(int64_t)kk * p.n + col] : 0.f;
    }
  };
  const auto store = [&]() {  // registers -> shared
#pragma unroll
    for (int i = 0; i < kXLoads; ++i) {
      const int e = tid + i * kThreads;
      xs[e % kBK][e / kBK] = xr[i];
    }
#pragma unroll
    for (int i = 0; i < kWLoads; ++i) {
      const int e = tid + i * kThreads;
      ws[e / kBN][e % kBN] = wr[i];
    }
  };

  float acc[TM][kTN], total[TM][kTN] = {};
  for (int r = r_first; r < r_last; ++r) {
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
      for (int j = 0; j < kTN; ++j) acc[i][j] = 0.f;
    const int t0 = range_begin(k_tiles, r, splits), t1 = range_begin(k_tiles, r + 1, splits);
    if (t0 < t1) load(t0);
    for (int t = t0; t < t1; ++t) {
      __syncthreads();  // every thread is done with the previous tile
      store();
      __syncthreads();
      if (t + 1 < t1) load(t + 1);  // in flight while this tile is multiplied
#pragma unroll 8
      for (int kk = 0; kk < kBK; ++kk) {
        float a[TM], b[kTN];
#pragma unroll
        for (int i = 0; i < TM; ++i) a[i] = xs[kk][ty + 16 * i];
#pragma unroll
        for (int j = 0; j < kTN; ++j) b[j] = ws[kk][tx + 16 * j];
#pragma unroll
        for (int i = 0; i < TM; ++i)
#pragma unroll
          for (int j = 0; j < kTN; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
      }
    }
    // range r is complete: into the total, in range order
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
      for (int j = 0; j < kTN; ++j) total[i][j] = r == r_first ? acc[i][j] : __fadd_rn(total[i][j], acc[i][j]);
  }

#pragma unroll
  for (int i = 0; i < TM; ++i)
#pragma unroll
    for (int j = 0; j < kTN; ++j) {
      const int row = m0 + ty + 16 * i, col = n0 + tx + 16 * j;
      if (row >= p.m || col >= p.n) continue;
      if (to_workspace) {
        p.workspace[((int64_t)blockIdx.z * p.m + row) * p.n + col] = total[i][j];
      } else {
        const float v = total[i][j];
        p.y[(int64_t)row * p.y_stride + col] = p.bias ? __fadd_rn(v, p.bias[col]) : v;
      }
    }
}

// y = ((p0 + p1) + p2 ...) (+ bias), the ranges' partial sums in range order.
__global__ void __launch_bounds__(kThreads) invariant_gemm_f32_combine(InvariantGemmF32Params p, int splits) {
  const int64_t plane = (int64_t)p.m * p.n;
  const int64_t i = (int64_t)blockIdx.x * kThreads + threadIdx.x;
  if (i >= plane) return;
  const int row = (int)(i / p.n), col = (int)(i % p.n);
  float v = p.workspace[i];
  for (int s = 1; s < splits; ++s) v = __fadd_rn(v, p.workspace[s * plane + i]);
  p.y[(int64_t)row * p.y_stride + col] = p.bias ? __fadd_rn(v, p.bias[col]) : v;
}

// One block per range (workspace + combine) where the output tiles alone would leave most
// multiprocessors idle; else one block walks every range. A function of M, but not of a row's sums.
bool ranges_to_workspace(int m, int n, int splits, int num_sms) {
  return splits > 1 && m_tiles_of(m) * n_tiles_of(n) < (int64_t)num_sms;
}

int resolved_split(int k, int n, int num_sms, int split) {
  return split == 0 ? invariant_gemm_f32_split(k, n, num_sms) : split;
}

}  // namespace

int invariant_gemm_f32_split(int k, int n, int num_sms) {
  // Up to about four blocks per multiprocessor for a one-tile-high launch (decode: enough loads in
  // flight to stream the weights), while every range keeps at least four k tiles. A function of K,
  // N and the device only.
  const int tiles = n_tiles_of(n), k_tiles = k_tiles_of(k);
  int splits = 1;
  while (splits < kMaxSplit && tiles * splits < 4 * num_sms && k_tiles >= 8 * splits) splits *= 2;
  return splits;
}

int64_t invariant_gemm_f32_workspace(int m, int n, int k, int num_sms, int split) {
  const int splits = resolved_split(k, n, num_sms, split);
  return m > 0 && n > 0 && ranges_to_workspace(m, n, splits, num_sms) ? (int64_t)splits * m * n : 0;
}

int launch_invariant_gemm_f32(const InvariantGemmF32Params& p, void* stream) {
  if (p.m < 0 || p.n < 0 || p.k <= 0 || p.x_stride < 0 || p.y_stride < 0) return -1;
  const int splits = resolved_split(p.k, p.n, p.num_sms, p.split);
  if ((splits != 1 && splits != 2 && splits != 4 && splits != kMaxSplit) || splits > k_tiles_of(p.k)) return -1;
  if (p.m == 0 || p.n == 0) return 0;
  const bool to_workspace = ranges_to_workspace(p.m, p.n, splits, p.num_sms);
  if (to_workspace && p.workspace == nullptr) return -1;
  if (m_tiles_of(p.m) > 65535) return -1;  // grid y
  const dim3 grid((unsigned)n_tiles_of(p.n), (unsigned)m_tiles_of(p.m), to_workspace ? (unsigned)splits : 1u);
  const peStream_t s = static_cast<peStream_t>(stream);
  if (p.m <= 16)
    invariant_gemm_f32_kernel<1><<<grid, kThreads, 0, s>>>(p, splits, to_workspace);
  else
    invariant_gemm_f32_kernel<4><<<grid, kThreads, 0, s>>>(p, splits, to_workspace);
  peError_t rc = peGetLastError();
  if (rc != peSuccess || !to_workspace) return (int)rc;
  const int64_t blocks = ((int64_t)p.m * p.n + kThreads - 1) / kThreads;
  invariant_gemm_f32_combine<<<(unsigned)blocks, kThreads, 0, s>>>(p, splits);
  return (int)peGetLastError();
}
