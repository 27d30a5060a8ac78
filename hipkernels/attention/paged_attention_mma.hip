// Paged GQA attention on tensor cores (mma.sync m16n8k16; NVIDIA sm_80 and later): the semantics,
// split rule and workspace of paged_attention.hip, for head dims 64 / 128 / 256 (D_qk == D_v).
//
// Why: the FMA kernel does q_len x G (token, head) pairs per key on the CUDA cores, so a verify step
// (q_len = 1 + k) costs about q_len x a decode step once it is compute-bound (b64 ctx 4096: q = 5
// costs 4.4x). Here the pairs of a block are the 16 rows of one m16 tile, so any q_len x G <= 16
// costs what decode costs: the tensor cores have ~10x the throughput that the K/V bytes need.
//
// One block of 4 warps per (row, kv head, key split, tile of 16 pairs m = i * G + h). Warp w owns
// keys 16 w .. 16 w + 15 of every 64-key tile of the split: it copies them (cp.async, its own
// STAGES-deep pipeline, no block barrier in the loop), computes S = Q K^T (2 n8 tiles), an online
// softmax (base 2) over them, and O += P V with P straight from the S accumulators. The 4 warps'
// (max, sum, O) are merged through shared memory in warp order at the end. Every step of a pair's
// arithmetic depends only on its own row of Q, the keys and the split rule, never on the other
// pairs of the tile, q_len or the batch, so decode and verify rows give the same bits.
#include "common/hip_compat.h"
#include "attention/paged_attention.h"
#include "attention/attention_common.h"
#include "common/mma_sync.h"

#include <math.h>
#include <stdlib.h>

#if !defined(PE_HIP)
namespace {

using namespace pe_attn;
using namespace pe_mma;

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kRows = 16;                  // pairs per block (one m16 tile)
constexpr int kWarpKeys = 16;              // keys per warp per tile
constexpr int kTileKeys = kWarps * kWarpKeys;

// Element offset of 16-byte chunk c of row r in a [16][D] tile; chunks XOR-swizzled by row so that
// the 8 rows an ldmatrix reads at one column hit 8 different bank groups.
template <int D>
PE_DEVICE int swz(int r, int c) { return r * D + ((c ^ (r & 7)) << 3); }

// Shared memory: the key pipeline, stage-major ([stage][warp] K [16][D] then V [16][D]); the
// block's merge buffer of warp results (fp32 [warp][16][D]: exactly one stage) reuses the last
// stage, so that a walking block copies its next range's first STAGES - 1 tiles while it merges;
// then the warps' (max, sum) pairs [warp][16][2].
template <int D, int STAGES>
struct SmemBytes {
  static constexpr int kPipe = STAGES * kWarps * 2 * kWarpKeys * D * 2;
  static constexpr int kMergeAt = (STAGES - 1) * kWarps * 2 * kWarpKeys * D * 2;
  static_assert(kWarps * kRows * D * 4 == kPipe - kMergeAt, "the merge buffer is one stage");
  static constexpr int value = kPipe + kWarps * kRows * 2 * 4;
};

template <typename T, int D, int STAGES>
__global__ void __launch_bounds__(kThreads) paged_attention_mma_kernel(PagedAttentionParams p) {
  pe_pdl_wait();
  constexpr int NC = D / 8;                    // 16-byte chunks per K / V row
  constexpr int WARP_STAGE = 2 * kWarpKeys * D;  // elements: K [16][D] then V [16][D]
  constexpr int CPL = kWarpKeys * NC / 32;     // chunks per lane per matrix
  extern __shared__ __align__(16) unsigned char smem_raw[];

  const int Hkv = p.num_kv_heads;
  const int Hq = p.num_q_heads;
  const int G = Hq / Hkv;
  int row, kvh, m_begin;
  if (!block_tile(p, kRows, &row, &kvh, &m_begin)) return;
  const int q0 = p.query_start_loc[row];
  const int q_len = p.query_start_loc[row + 1] - q0;
  const int ctx = p.context_lens[row];
  const int m_count = q_len * G;
  if (m_begin >= m_count) return;
  int nsplit, split_size;
  gqa_row_splits(p, ctx, q_len, &nsplit, &split_size);
  const int split = blockIdx.x;
  if (split >= nsplit) return;
  // Batch-invariant rows of one split walk their key ranges [r U, (r + 1) U) here, each from a
  // fresh state, merged in range order (merge_range) as the combine merges a split row's ranges.
  const bool walk = p.fixed_splits && nsplit == 1;

  const int tid = threadIdx.x;
  const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, q = lane & 3;
  // This thread's pairs: rows g and g + 8 of the tile.
  int lim[2], tok[2], head[2];
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int m = m_begin + g + 8 * j;
    const bool valid = m < m_count;
    const int i = valid ? m / G : 0;
    tok[j] = q0 + i;
    head[j] = kvh * G + (valid ? m - i * G : 0);
    lim[j] = valid ? ctx - (q_len - 1 - i) : -1;  // keys < lim[j]; -1: no key (padding row)
  }
  const int m_last = min(m_begin + kRows, m_count) - 1;
  const int k_lim = ctx - (q_len - 1 - m_last / G);  // no pair of the tile sees more keys
  const int nranges = walk && k_lim > split_size ? (k_lim + split_size - 1) / split_size : 1;
  int k_begin = split * split_size;
  int k_end = min(min(ctx, k_begin + split_size), k_lim);
  int ntiles = k_end > k_begin ? (k_end - k_begin + kTileKeys - 1) / kTileKeys : 0;

  const T* kcache = static_cast<const T*>(p.k_cache);
  const T* vcache = static_cast<const T*>(p.v_cache);
  const int32_t* btab = p.block_tables + (int64_t)row * p.max_blocks_per_row;
  const int bs = p.block_size;
  const bool bs_pow2 = (bs & (bs - 1)) == 0;
  const int bs_shift = __ffs(bs) - 1;
  const int64_t slot_stride = (int64_t)Hkv * D;
  T* wsm = reinterpret_cast<T*>(smem_raw) + warp * WARP_STAGE;  // stage t: wsm + t * kWarps * WARP_STAGE

  // Block-table entry of key (lane & 15) of this warp's part of tile t; -1 outside [k_begin, k_end).
  auto load_blk = [&](int t) -> int {
    const int key = k_begin + t * kTileKeys + warp * kWarpKeys + (lane & 15);
    if (t >= ntiles || key >= k_end) return -1;
    return btab[bs_pow2 ? key >> bs_shift : key / bs];
  };
  auto issue = [&](int t, int blk_mine) {
    if (t < ntiles) {
      T* ks = wsm + (t % STAGES) * kWarps * WARP_STAGE;
      T* vs = ks + kWarpKeys * D;
#pragma unroll
      for (int i = 0; i < CPL; ++i) {
        const int c = lane + 32 * i;
        const int kr = c / NC, ch = c - kr * NC;
        const int blk = __shfl_sync(0xffffffffu, blk_mine, kr);
        const int key = k_begin + t * kTileKeys + warp * kWarpKeys + kr;
        const int within = bs_pow2 ? key & (bs - 1) : key - (key / bs) * bs;
        const int64_t off = (blk >= 0 ? ((int64_t)blk * bs + within) * slot_stride : 0) + (int64_t)kvh * D + ch * 8;
        copy16_async(ks + swz<D>(kr, ch), kcache + off, blk >= 0);  // K and V caches share their layout
        copy16_async(vs + swz<D>(kr, ch), vcache + off, blk >= 0);
      }
    }
    copy_commit();
  };
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) issue(s, load_blk(s));
  int nblk = load_blk(STAGES - 1);

  // Q as A fragments: qa[kk] = rows g / g + 8, dims 16 kk + 2 q (+1) and 16 kk + 8 + 2 q (+1).
  uint32_t qa[D / 16][4];
  const T* qbase = static_cast<const T*>(p.q);
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk)
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h)
        qa[kk][j + 2 * h] =
            lim[j] >= 0 ? *reinterpret_cast<const uint32_t*>(qbase + (int64_t)tok[j] * p.q_stride_token +
                                                             (int64_t)head[j] * p.q_stride_head + 16 * kk + 8 * h + 2 * q)
                        : 0u;

  const float qscale = p.scale * kLog2e;
  float* s_o = reinterpret_cast<float*>(smem_raw + SmemBytes<D, STAGES>::kMergeAt);  // [warp][16][D]
  float* s_ml = reinterpret_cast<float*>(smem_raw + SmemBytes<D, STAGES>::kPipe);     // [warp][16][2]
  // A walk's running state between ranges, past the pipeline / merge buffers: [16][D] values and
  // [16][NC][2] (m, l) per 8-value chunk (launch() adds it where a row may walk several ranges).
  float* s_wo = reinterpret_cast<float*>(smem_raw + SmemBytes<D, STAGES>::value);
  float* s_wml = s_wo + kRows * D;
  for (int r = 0; r < nranges; ++r) {
    float o[D / 8][4];
#pragma unroll
    for (int nd = 0; nd < D / 8; ++nd) o[nd][0] = o[nd][1] = o[nd][2] = o[nd][3] = 0.f;
    float mx[2] = {neg_inf(), neg_inf()}, ls[2] = {0.f, 0.f};

    for (int t = 0; t < ntiles; ++t) {
      copy_wait<STAGES - 2>();
      __syncwarp();
      issue(t + STAGES - 1, nblk);
      nblk = load_blk(t + STAGES);
      const T* ks = wsm + (t % STAGES) * kWarps * WARP_STAGE;
      const T* vs = ks + kWarpKeys * D;

      float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        uint32_t b[4];  // matrices: keys 0-7 / 8-15 (lane / 16) x dims 16 kk + 0 / + 8 ((lane / 8) & 1)
        ldsm_x4(b, ks + swz<D>(((lane >> 4) << 3) + (lane & 7), 2 * kk + ((lane >> 3) & 1)));
        mma16816<T>(s[0], qa[kk], b[0], b[1]);
        mma16816<T>(s[1], qa[kk], b[2], b[3]);
      }
      const int kbase = k_begin + t * kTileKeys + warp * kWarpKeys + 2 * q;
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        float hmax = neg_inf();
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float& v = s[nt][2 * j + e];
            const int key = kbase + 8 * nt + e;
            v = key < lim[j] && key < k_end ? v * qscale : neg_inf();
            hmax = fmaxf(hmax, v);
          }
        hmax = fmaxf(hmax, pe_shfl_xor(hmax, 1));
        hmax = fmaxf(hmax, pe_shfl_xor(hmax, 2));
        const float mn = fmaxf(mx[j], hmax);
        if (mn != mx[j]) {  // quad-uniform
          const float alpha = exp2f(mx[j] - mn);  // 0 when the old max was -inf (o and ls are 0 then)
          ls[j] *= alpha;
#pragma unroll
          for (int nd = 0; nd < D / 8; ++nd) o[nd][2 * j] *= alpha, o[nd][2 * j + 1] *= alpha;
          mx[j] = mn;
        }
        const float ref = mn == neg_inf() ? 0.f : mn;
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float& v = s[nt][2 * j + e];
            v = exp2f(v - ref);
            ls[j] += v;
          }
      }
      // P as the A fragment of the 16 keys: (row g / g + 8) x (keys 2q, 2q+1 / 8 + 2q, 9 + 2q).
      const uint32_t pa[4] = {pack2<T>(s[0][0], s[0][1]), pack2<T>(s[0][2], s[0][3]), pack2<T>(s[1][0], s[1][1]),
                              pack2<T>(s[1][2], s[1][3])};
#pragma unroll
      for (int nd = 0; nd < D / 8; nd += 2) {
        uint32_t b[4];  // transposed: keys 0-7 / 8-15 ((lane / 8) & 1) x dims 8 nd + 0 / + 8 (lane / 16)
        ldsm_x4<true>(b, vs + swz<D>((((lane >> 3) & 1) << 3) + (lane & 7), nd + (lane >> 4)));
        mma16816<T>(o[nd], pa, b[0], b[1]);
        mma16816<T>(o[nd + 1], pa, b[2], b[3]);
      }
    }
    if (r == nranges - 1) pe_pdl_launch_dependents();
    copy_wait<0>();
    __syncthreads();  // every warp is done with the last stage: it becomes the merge buffer
    if (r + 1 < nranges) {  // the next range's first tiles (stages 0 .. STAGES - 2) load meanwhile
      k_begin = (r + 1) * split_size;
      k_end = min(k_begin + split_size, k_lim);
      ntiles = (k_end - k_begin + kTileKeys - 1) / kTileKeys;
#pragma unroll
      for (int s = 0; s < STAGES - 1; ++s) issue(s, load_blk(s));
      nblk = load_blk(STAGES - 1);
    }

#pragma unroll
    for (int j = 0; j < 2; ++j) {
      float l = ls[j];
      l += pe_shfl_xor(l, 1);
      l += pe_shfl_xor(l, 2);
      const int rr = g + 8 * j;
      if (q == 0) s_ml[(warp * kRows + rr) * 2] = mx[j], s_ml[(warp * kRows + rr) * 2 + 1] = l;
#pragma unroll
      for (int nd = 0; nd < D / 8; ++nd)
        *reinterpret_cast<float2*>(s_o + (warp * kRows + rr) * D + 8 * nd + 2 * q) =
            make_float2(o[nd][2 * j], o[nd][2 * j + 1]);
    }
    __syncthreads();

    const bool direct = nsplit == 1;
    for (int idx = tid; idx < kRows * NC; idx += kThreads) {
      const int rr = idx / NC;
      const int v = idx - rr * NC;
      const int m = m_begin + rr;
      if (m >= m_count) continue;
      const int i_tok = m / G;
      const int h = kvh * G + (m - i_tok * G);
      if (!walk) {
        merge_and_store_pair<T, kWarps>(p, s_ml + rr * 2, kRows * 2, s_o + rr * D + v * 8, kRows * D, row, q0 + i_tok,
                                        i_tok, h, v, split, direct);
        continue;
      }
      float wm = neg_inf(), wl = 0.f, wo[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      if (r > 0) {
        wm = s_wml[idx * 2], wl = s_wml[idx * 2 + 1];
#pragma unroll
        for (int j = 0; j < 8; ++j) wo[j] = s_wo[rr * D + v * 8 + j];
      }
      const bool last = r == nranges - 1;
      walk_merge_pair<T, kWarps>(p, s_ml + rr * 2, kRows * 2, s_o + rr * D + v * 8, kRows * D, q0 + i_tok, h, v, last,
                                 wm, wl, wo);
      if (!last) {
        s_wml[idx * 2] = wm, s_wml[idx * 2 + 1] = wl;
#pragma unroll
        for (int j = 0; j < 8; ++j) s_wo[rr * D + v * 8 + j] = wo[j];
      }
    }
    if (r + 1 < nranges) __syncthreads();  // the merge buffer becomes the last stage again
  }
}

template <typename T, int D, int STAGES>
int launch(const PagedAttentionParams& p, peStream_t s) {
  constexpr int kSmem = SmemBytes<D, STAGES>::value;
  constexpr int kWalk = kRows * (D + 2 * (D / 8)) * 4;  // a walk's running state between ranges
  // Only rows of more than kSplitMaxQueryLen queries walk several ranges (decode keeps its occupancy).
  const bool walks = p.fixed_splits && p.max_query_len > kPagedAttnSplitMaxQueryLen;
  auto kernel = paged_attention_mma_kernel<T, D, STAGES>;
  cudaError_t rc = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem + kWalk);
  if (rc != cudaSuccess) return static_cast<int>(rc);
  PagedAttentionParams f;
  const dim3 grid = gqa_grid(p, kRows, &f);
  return static_cast<int>(pe_launch(kernel, grid, dim3(kThreads), walks ? kSmem + kWalk : kSmem, s, p.pdl, f));
}

template <typename T>
int launch_typed(const PagedAttentionParams& p, peStream_t s) {
  switch (p.head_dim_qk) {
    case 64: return launch<T, 64, 4>(p, s);
    case 128: return launch<T, 128, 3>(p, s);
    case 256: return launch<T, 256, 2>(p, s);
    default: return -1;
  }
}

}  // namespace

int launch_paged_attention_mma(const PagedAttentionParams& p, void* stream) {
  if (p.head_dim_qk != p.head_dim_v) return -1;
  const peStream_t s = static_cast<peStream_t>(stream);
  if (p.dtype == PE_FLOAT16) return launch_typed<pe_half>(p, s);
  if (p.dtype == PE_BFLOAT16) return launch_typed<pe_bf16>(p, s);
  return -1;
}
#endif  // !PE_HIP
