// MLA decode attention, small tile (SmallTile of mla_tile.h: 16 query-head pairs, 4 one-warp groups,
// 1 stage of 32 keys, FMA products, 57.5 KB of shared memory): what hipcc builds (AMD gfx90a has
// 64 KB per block), and on NVIDIA under p.mla_small_tile or without the fast tile's shared memory.
// Semantics: mla_attention.h; key ranges, work assignment and merge: mla_ranges.h.
//
// One block per (row, range or whole row, tile of kM pairs m = i * Hq + h); the queries stay in
// shared memory, the keys stream through it in tiles of kN keys. Group wg computes, for all kM pairs,
//   S = Q K^T   over keys kNS wg .. +kNS of the tile and all 576 dims
//   softmax     online, fp32, base 2; the groups' row maxima meet through shared memory
//   O += P V    value columns kNO wg .. +kNO (V = the first 512 dims of the keys), P passed through
//               shared memory as 16-bit values
// so a thread owns the same two rows in S and in O. A range's row sum is the groups' sums added in
// group order; a walking block folds each range but its last into its slab after the tile that
// ends it (the next tile's copy is already issued) and restarts from the fresh state.
#include "common/hip_compat.h"
#include "attention/attention_common.h"
#include "attention/mla_kernels.h"
#include "attention/mla_ranges.h"
#include "attention/mla_tile.h"
#include "common/wgmma_tile.h"

#include <math.h>

namespace {

using namespace pe_attn;
using namespace pe_mla;
using pe_wg::slab_off;

template <typename T, typename C>
__global__ void __launch_bounds__(C::kThreads, 1) mla_small_kernel(PagedAttentionParams p) {
  constexpr int kM = C::kM, kN = C::kN, kNS = C::kNS, kNO = C::kNO, kS = kNS / 2, kO = kNO / 2;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  __shared__ int s_slot;
  unsigned char* smem = smem_raw + pe_wg::align_1024(smem_raw);
  T* sQ = reinterpret_cast<T*>(smem);                      // [kM][576] slab tile
  T* sK = sQ + C::kQElems;                                 // [kStages][kN][576] slab tiles
  T* sP = sK + C::kStages * C::kKElems;                    // [kM][kN] slab tile
  float* sMax = reinterpret_cast<float*>(sP + C::kPElems); // [kGroups key ranges][kM]
  float* sSum = sMax + C::kGroups * kM;                    // [kGroups key ranges][kM]

  MlaWork w;
  if (!mla_work<kM, kN>(p, &w)) return;
  const int Hq = p.num_q_heads;
  const int ntiles = w.t_end - w.t_begin;  // local tile i is key tile w.t_begin + i
  const int tpr = w.tiles_per_range;
  const bool walk = w.split < 0;
  const bool use_slab = walk && ntiles > 0 && (w.t_end - 1) / tpr > w.t_begin / tpr;
  const int tid = threadIdx.x;

  // Copies: kTpr threads per key, thread sub copies chunks sub, sub + kTpr, ...
  constexpr int kTpr = C::kTpr, kTprQ = C::kTprQ;
  const int my_row = tid / kTpr;
  const int sub = tid - my_row * kTpr;
  const T* kcache = static_cast<const T*>(p.k_cache);
  const int32_t* btab = p.block_tables + (int64_t)w.row * p.max_blocks_per_row;
  const int bs = p.block_size;
  const bool bs_pow2 = (bs & (bs - 1)) == 0;
  const int bs_shift = __ffs(bs) - 1;
  auto load_block = [&](int i) -> int {  // block of this thread's key of tile i; -1: not a key
    const int key = (w.t_begin + i) * kN + my_row;
    if (i >= ntiles || key >= w.k_end) return -1;
    return btab[bs_pow2 ? key >> bs_shift : key / bs];
  };
  auto issue = [&](int i, int blk) {  // zero-fill past k_end: unused pages are never read
    if (i < ntiles) {
      const int key = (w.t_begin + i) * kN + my_row;
      const int within = bs_pow2 ? key & (bs - 1) : key - (key / bs) * bs;
      const T* src = kcache + (blk >= 0 ? ((int64_t)blk * bs + within) * kDqk : 0);
      T* dst = sK + (C::kStages == 2 ? i & 1 : 0) * C::kKElems;
#pragma unroll
      for (int c8 = 0; c8 < kChunks / kTpr; ++c8) {
        const int c = (sub + kTpr * c8) * 8;
        copy16_async(dst + slab_off(my_row, c, kN), src + c, blk >= 0);
      }
    }
    copy_commit();
  };
  {  // the tile's queries (kTprQ threads per row), in the same copy group as the first key tile
    const int q_row = tid / kTprQ, q_sub = tid - q_row * kTprQ;
    const int m = w.m_begin + q_row;
    const bool valid = m < w.m_count;
    const int i = valid ? m / Hq : 0;
    const T* src = static_cast<const T*>(p.q) + (int64_t)(w.q0 + i) * p.q_stride_token +
                   (int64_t)(valid ? m - i * Hq : 0) * p.q_stride_head;
#pragma unroll
    for (int j = 0; j < kChunks / kTprQ; ++j) {
      const int c = (q_sub + kTprQ * j) * 8;
      copy16_async(sQ + slab_off(q_row, c, kM), src + c, valid);
    }
  }
  issue(0, load_block(0));
  int nblk = load_block(1);
  if (use_slab && tid == 0) {
    const int nslots = (int)min((int64_t)p.mla_lock_count, p.mla_acc_floats / (kM * kDv));
    s_slot = acquire_slab(p, nslots);
  }

  // This thread's rows (the same in S and O): r[j] = 16 (warp % kWarps) + g + 8 j; its group wg
  // owns keys kNS wg .. +kNS of each tile in S and value columns kNO wg .. +kNO in O.
  const int warp = tid >> 5, wg = warp / C::kWarps, lane = tid & 31, g = lane >> 2, q = lane & 3;
  int r[2], lim[2];
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    r[j] = 16 * (warp % C::kWarps) + g + 8 * j;
    const int m = w.m_begin + r[j];
    lim[j] = m < w.m_count ? w.ctx - (w.q_len - 1 - m / Hq) : 0;  // keys < lim
  }
  const float qscale = p.scale * kLog2e;
  const int col0 = kNO * wg + 2 * q;
  MergedRow st[2];

  // Running max mx and this lane's partial sum ls per row; o: the wgmma accumulator layout.
  float mx[2] = {neg_inf(), neg_inf()}, ls[2] = {0.f, 0.f}, o[kO];
#pragma unroll
  for (int k = 0; k < kO; ++k) o[k] = 0.f;

  // A range's row sums (lane -> group -> all groups in group order) and the fold of this group's
  // columns into the merged state; the caller has passed a barrier since sSum was last read.
  auto end_range = [&](bool last) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      float l = ls[j];
      l += pe_shfl_xor(l, 1);
      l += pe_shfl_xor(l, 2);
      if (q == 0) sSum[wg * kM + r[j]] = l;
    }
    __syncthreads();
    float L[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      L[j] = sSum[r[j]];  // in group order: the same sum whatever the row's position in the batch
#pragma unroll
      for (int gi = 1; gi < C::kGroups; ++gi) L[j] += sSum[gi * kM + r[j]];
    }
    float* slab = use_slab ? p.mla_acc + (int64_t)s_slot * kM * kDv : nullptr;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int m = w.m_begin + r[j];
      if (m >= w.m_count) continue;
      const int i_tok = m / Hq;
      const int h = m - i_tok * Hq;
      const float inv = inverse_sum(L[j]);
      const int tok = w.q0 + i_tok;
      if (walk) {
        T* out = static_cast<T*>(p.out) + (int64_t)tok * p.out_stride_token + (int64_t)h * p.out_stride_head + col0;
        float* lse_out = p.lse != nullptr ? p.lse + (int64_t)tok * Hq + h : nullptr;
        fold_range_row<T, kNO / 8>(st[j], partial_lse(mx[j], L[j]), inv, o + 2 * j,
                                   slab != nullptr ? slab + r[j] * kDv + col0 : nullptr, out, lse_out,
                                   wg == 0 && q == 0, last);
      } else {  // a split block: the range's partial to the workspace (the combine merges)
        const int64_t ws = ((int64_t)(p.ws_start[w.row] + i_tok) * Hq + h) * p.max_splits + w.split;
        float* dst = p.ws_out + ws * kDv + col0;
#pragma unroll
        for (int nt = 0; nt < kNO / 8; ++nt)
          *reinterpret_cast<float2*>(dst + 8 * nt) = make_float2(o[4 * nt + 2 * j] * inv, o[4 * nt + 2 * j + 1] * inv);
        if (wg == 0 && q == 0) p.ws_lse[ws] = partial_lse(mx[j], L[j]);
      }
    }
  };

  for (int i = 0; i < ntiles; ++i) {
    const int t = w.t_begin + i;
    copy_wait<0>();  // tile i (and at i = 0 the queries) landed, this thread's copies ...
    __syncthreads();  // ... everyone's; everyone is done with tile i - 1, whose stage is refilled now
    if constexpr (C::kStages > 1) {
      issue(i + 1, nblk);
      nblk = load_block(i + 2);
    }
    const T* kt = sK + (C::kStages == 2 ? i & 1 : 0) * C::kKElems;

    // FMA products, one call at a time: unrolled, hipcc would hoist the shared-memory loads of all
    // of them and spill (~1 KB of scratch per lane on gfx90a).
    float s[kS];
#pragma unroll
    for (int k = 0; k < kS; ++k) s[k] = 0.f;
#pragma unroll 1
    for (int ks = 0; ks < kDqk / 16; ++ks)
      pe_wg::product_nk<T, kNS, C::kWarps, false>(s, sQ, kM, 0, 16 * ks, kt, kN, kNS * wg, 16 * ks);

    // Scale into the base-2 domain, mask, and publish this group's row maxima.
    const int key0 = t * kN + kNS * wg + 2 * q;
    float hmax[2] = {neg_inf(), neg_inf()};
#pragma unroll
    for (int k = 0; k < kS; ++k) {
      const int j = (k >> 1) & 1;
      s[k] = key0 + 8 * (k >> 2) + (k & 1) < lim[j] ? s[k] * qscale : neg_inf();
      hmax[j] = fmaxf(hmax[j], s[k]);
    }
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      hmax[j] = fmaxf(hmax[j], pe_shfl_xor(hmax[j], 1));
      hmax[j] = fmaxf(hmax[j], pe_shfl_xor(hmax[j], 2));
      if (q == 0) sMax[wg * kM + r[j]] = hmax[j];
    }
    __syncthreads();

    // P = exp2(S - new max) as 16-bit values for P V; ls accumulates the fp32 values; o is rescaled
    // where the row max moved (rarely after the first tiles).
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      float gmax = sMax[r[j]];
#pragma unroll
      for (int gi = 1; gi < C::kGroups; ++gi) gmax = fmaxf(gmax, sMax[gi * kM + r[j]]);
      const float mn = fmaxf(mx[j], gmax);
      const float ref = mn == neg_inf() ? 0.f : mn;  // a row with no key yet: all P are 0
      if (mn != mx[j]) {
        const float alpha = exp2f(mx[j] - mn);  // 0 when the old max was -inf (o and ls are 0 then)
        ls[j] *= alpha;
#pragma unroll
        for (int nt = 0; nt < kNO / 8; ++nt) o[4 * nt + 2 * j] *= alpha, o[4 * nt + 2 * j + 1] *= alpha;
        mx[j] = mn;
      }
#pragma unroll
      for (int nt = 0; nt < kNS / 8; ++nt) {
        const float p0 = exp2f(s[4 * nt + 2 * j] - ref), p1 = exp2f(s[4 * nt + 2 * j + 1] - ref);
        ls[j] += p0 + p1;
        *reinterpret_cast<uint32_t*>(sP + slab_off(r[j], kNS * wg + 8 * nt + 2 * q, kM)) = pack2<T>(p0, p1);
      }
    }
    __syncthreads();

#pragma unroll 1
    for (int kk = 0; kk < kN / 16; ++kk)
      pe_wg::product_kn<T, kNO, C::kWarps, false>(o, sP, kM, 0, 16 * kk, kt, kN, 16 * kk, kNO * wg);
    if constexpr (C::kStages == 1) {  // one stage: refill it once everyone is done with tile i
      __syncthreads();
      issue(i + 1, nblk);
      nblk = load_block(i + 2);
    }
    if (walk && i + 1 < ntiles && (t + 1) % tpr == 0) {  // a range ends here, not the last one
      end_range(false);
#pragma unroll
      for (int k = 0; k < kO; ++k) o[k] = 0.f;
      mx[0] = mx[1] = neg_inf();
      ls[0] = ls[1] = 0.f;
    }
  }
  copy_wait<0>();
  __syncthreads();  // also: every group has read sSum of the last folded range
  end_range(true);
  if (use_slab) {
    __syncthreads();  // every slab access of the block is done
    if (tid == 0) release_slab(p, s_slot);
  }
}

}  // namespace

int launch_mla_small(const PagedAttentionParams& p, peStream_t s) {
  using C = SmallTile;
  return launch_mla_grid(p.dtype == PE_FLOAT16 ? &mla_small_kernel<pe_half, C> : &mla_small_kernel<pe_bf16, C>,
                         C::kM, C::kThreads, C::kSmemBytes, p, s);
}
