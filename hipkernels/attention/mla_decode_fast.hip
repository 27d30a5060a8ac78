// MLA decode attention, fast tile (NVIDIA sm_90a: FastTile of mla_tile.h, wgmma, ~226 KB of shared
// memory, one block per SM). Semantics: mla_attention.h; key ranges, work assignment and merge:
// mla_ranges.h.
//
// Why a kernel of its own: per cached token MLA does ~128 x (576 + 512) x 2 flops for 1152 bytes of
// KV (~240 flop/byte), so the work must run on tensor cores and each KV tile must be loaded once for
// a large group of query heads. One block per (row, range or whole row, tile of 64 query-head pairs
// m = i * Hq + h); the tile's queries stay in shared memory, the keys stream through two stages of
// 64 keys (cp.async). The two warpgroups take different roles (as FlashMLA does), so that the tensor
// cores rarely wait:
//   warpgroup 0: S = Q K^T for all 64 keys of the tile (m64n64k16 x 36), the whole online softmax
//                in registers (a row's 64 keys sit in one quad of lanes), P and the rescale factor
//                of each row into shared memory, then O[:, 0:256] += P V, left running while it
//                issues the next tile's S (the tensor cores take them in order).
//   warpgroup 1: issues the key-tile copies (two tiles ahead of the one in use), and
//                O[:, 256:512] += P V, running while warpgroup 0 computes S of the next tile.
// Both warpgroups issue their products on descriptors computed once (wgmma_tile.h desc_add), and the
// softmax is mla_softmax.h's: with 8 warps per SM, instructions between a tile's S and its P V, not
// the tensor cores, had bounded the loop.
// Named barriers (ids 1-4, 256 threads; __syncthreads is id 0) hand over: tile t landed (K_READY),
// P(t) written (P_READY), P read (P_FREE), key stage of tile t free (K_FREE). barrier.sync /
// barrier.arrive, not the .aligned bar.* forms, which every lane of a warp must execute together
// (compute-sanitizer synccheck reports divergent lanes there); same speed.
// A walking block ends each range but its last in the loop: warpgroup 0 publishes the range's row
// sums and maxima with P of its last tile, each warpgroup folds its half of O into the slab
// (fold_fast_row, mla_slab.h: a per-thread layout kept in L2) after that tile's products, and
// restarts from the fresh state; the next range's first tiles are already in flight.
#include "common/hip_compat.h"

#if !defined(PE_HIP)
#include "attention/attention_common.h"
#include "attention/mla_kernels.h"
#include "attention/mla_ranges.h"
#include "attention/mla_slab.h"
#include "attention/mla_softmax.h"
#include "attention/mla_tile.h"
#include "common/wgmma_tile.h"

#include <math.h>

#if defined(__CUDA_ARCH__) && !defined(PE_WGMMA)
#error "the fast MLA tile is built for sm_90a only (wgmma)"
#endif

namespace {

using namespace pe_attn;
using namespace pe_mla;
using pe_wg::slab_off;

PE_DEVICE void named_sync(int id) { asm volatile("barrier.sync %0, 256;\n" ::"r"(id) : "memory"); }
PE_DEVICE void named_arrive(int id) { asm volatile("barrier.arrive %0, 256;\n" ::"r"(id) : "memory"); }
constexpr int kBarKReady = 1, kBarPReady = 2, kBarPFree = 3, kBarKFree = 4;

template <typename T>
__global__ void __launch_bounds__(256, 1) mla_fast_kernel(PagedAttentionParams p) {
  using C = FastTile;
  constexpr int kM = C::kM, kN = C::kN;
  static_assert(kM == 64 && kN == 64 && C::kThreads == 256 && C::kStages == 2, "two warpgroups, 64 x 64 tiles");
  static_assert(C::kFloats >= 5 * kM, "sScale + two ranges of sums and maxima");
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* smem = smem_raw + pe_wg::align_1024(smem_raw);
  T* sQ = reinterpret_cast<T*>(smem);                        // [kM][576] slab tile
  T* sK = sQ + C::kQElems;                                   // [2][kN][576] slab tiles
  T* sP = sK + 2 * C::kKElems;                               // [kM][kN] slab tile
  float* sScale = reinterpret_cast<float*>(sP + C::kPElems); // [kM] rescale factor of O for tile t
  float* sSum = sScale + kM;                                 // [2][kM] a range's row sums, by range parity
  float* sMx = sSum + 2 * kM;                                // [2][kM] its row maxima
  // The slab slot, published by the barrier before the loop and read right after it; the first
  // write to sSum[kM ..] (the end of range 1) comes after every thread has passed P_READY(0).
  int& s_slot = *reinterpret_cast<int*>(sSum + kM);

  MlaWork w;
  if (!mla_work<kM, kN>(p, &w)) return;
  const int Hq = p.num_q_heads;
  const int ntiles = w.t_end - w.t_begin;  // local tile i is key tile w.t_begin + i
  const int tpr = w.tiles_per_range;
  const bool walk = w.split < 0;
  const bool use_slab = walk && ntiles > 0 && (w.t_end - 1) / tpr > w.t_begin / tpr;

  const int tid = threadIdx.x;
  const int warp = tid >> 5, wg = warp >> 2, lane = tid & 31, g = lane >> 2, q = lane & 3;
  const T* kcache = static_cast<const T*>(p.k_cache);
  const int32_t* btab = p.block_tables + (int64_t)w.row * p.max_blocks_per_row;
  const int bs = p.block_size;
  const bool bs_pow2 = (bs & (bs - 1)) == 0;
  const int bs_shift = __ffs(bs) - 1;
  // Key copies (warpgroup 1): 8 threads per 128-byte line of a key, so that one copy instruction of
  // a warp reads 4 whole lines; thread (key kc, chunk cc) copies chunks cc, cc + 8, ... of keys kc,
  // kc + 16, kc + 32, kc + 48.
  const int kc = (tid & 127) >> 3, cc = tid & 7;
  auto load_blocks = [&](int i, int (&blk)[4]) {  // blocks of this thread's keys of tile i; -1: not a key
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int key = (w.t_begin + i) * kN + kc + 16 * u;
      blk[u] = i < ntiles && key < w.k_end ? btab[bs_pow2 ? key >> bs_shift : key / bs] : -1;
    }
  };
  auto issue = [&](int i, const int (&blk)[4]) {  // zero-fill past k_end: unused pages are never read
    if (i < ntiles) {
      T* dst = sK + (i & 1) * C::kKElems;
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int key = (w.t_begin + i) * kN + kc + 16 * u;
        const int within = bs_pow2 ? key & (bs - 1) : key - (key / bs) * bs;
        const T* src = kcache + (blk[u] >= 0 ? ((int64_t)blk[u] * bs + within) * kDqk : 0);
#pragma unroll
        for (int c8 = 0; c8 < kChunks / 8; ++c8) {
          const int c = (cc + 8 * c8) * 8;
          copy16_async(dst + slab_off(kc + 16 * u, c, kN), src + c, blk[u] >= 0);
        }
      }
    }
    copy_commit();
  };
  {  // the tile's queries, all threads, 8 per 128-byte line: rows qr, qr + 32, chunks cc, cc + 8, ...
    const int qr = tid >> 3;
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int q_row = qr + 32 * u;
      const int m = w.m_begin + q_row;
      const bool valid = m < w.m_count;
      const int i = valid ? m / Hq : 0;
      const T* src = static_cast<const T*>(p.q) + (int64_t)(w.q0 + i) * p.q_stride_token +
                     (int64_t)(valid ? m - i * Hq : 0) * p.q_stride_head;
#pragma unroll
      for (int j = 0; j < kChunks / 8; ++j) {
        const int c = (cc + 8 * j) * 8;
        copy16_async(sQ + slab_off(q_row, c, kM), src + c, valid);
      }
    }
    copy_commit();
  }
  int nblk[4];
  if (wg == 1) {
    load_blocks(0, nblk);
    issue(0, nblk);
    load_blocks(1, nblk);
    issue(1, nblk);
    load_blocks(2, nblk);
    copy_wait<1>();  // queries and tile 0
  } else {
    copy_wait<0>();
  }
  if (use_slab && tid == 0) {
    const int nslots = (int)min((int64_t)p.mla_lock_count, p.mla_acc_floats / (kM * kDv));
    s_slot = acquire_slab(p, nslots);
  }
  pe_wg::fence_smem_for_async_reads();
  __syncthreads();

  // This thread's rows (the same in S and O): r[j] = 16 (warp % 4) + g + 8 j; its values of row j
  // in O are o[4 nt + 2 j + e], columns 256 wg + 8 nt + 2 q + e.
  int r[2];
#pragma unroll
  for (int j = 0; j < 2; ++j) r[j] = 16 * (warp & 3) + g + 8 * j;
  const int col0 = 256 * wg + 2 * q;
  const int slot = use_slab ? s_slot : 0;
  float* slab = use_slab ? p.mla_acc + (int64_t)slot * kM * kDv : nullptr;
  float* mine = use_slab ? slab + 4 * tid : nullptr;  // this thread's vectors (mla_slab.h)
  const uint64_t pol = use_slab ? slab_policy() : 0;
  MergedRow st[2];
  float o[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) o[i] = 0.f;
  float mx[2] = {neg_inf(), neg_inf()}, ls[2] = {0.f, 0.f};
  // Operand descriptors: Q, key stage 0 (stage 1 at + stage_desc), P, and this warpgroup's value
  // columns 256 wg .. of stage 0.
  const uint64_t q_desc = pe_wg::desc_k_major(sQ), k_desc = pe_wg::desc_k_major(sK);
  const uint64_t p_desc = pe_wg::desc_k_major(sP), v_desc = pe_wg::desc_mn_major(sK + 4 * wg * kN * 64, kN);
  constexpr uint64_t stage_desc = pe_wg::step_desc(C::kKElems);
  // Where the ranges end, counted instead of divided: tiles left in tile t's range, its parity.
  int to_range_end = tpr - w.t_begin % tpr, range_par = (w.t_begin / tpr) & 1;
  auto next_tile = [&](bool at_range_end) {
    to_range_end = at_range_end ? tpr : to_range_end - 1;
    range_par ^= at_range_end ? 1 : 0;
  };
  // Folds this warpgroup's half of O for a range (row sums L, maxima M) into the merged state.
  auto fold = [&](const float (&L)[2], const float (&M)[2], bool last) {
    T* out[2];
    float* lse_out[2];
    bool valid[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int m = w.m_begin + r[j];
      valid[j] = m < w.m_count;
      const int i_tok = valid[j] ? m / Hq : 0;
      const int h = m - i_tok * Hq;
      out[j] = static_cast<T*>(p.out) + (int64_t)(w.q0 + i_tok) * p.out_stride_token + (int64_t)h * p.out_stride_head + col0;
      lse_out[j] = p.lse != nullptr ? p.lse + (int64_t)(w.q0 + i_tok) * Hq + h : nullptr;
    }
    if (valid[0])
      fold_fast_row<T, 0>(st[0], partial_lse(M[0], L[0]), inverse_sum(L[0]), o, mine, out[0], lse_out[0],
                          wg == 0 && q == 0, last, pol);
    if (valid[1])
      fold_fast_row<T, 1>(st[1], partial_lse(M[1], L[1]), inverse_sum(L[1]), o, mine, out[1], lse_out[1],
                          wg == 0 && q == 0, last, pol);
  };

  if (wg == 0) {
    int lim[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int m = w.m_begin + r[j];
      lim[j] = m < w.m_count ? w.ctx - (w.q_len - 1 - m / Hq) : 0;  // keys < lim
    }
    const float qscale = p.scale * kLog2e;
    bool pv_pending = false;  // P V of the previous tile issued, not yet waited for
    // The stage of tile i and the other one (swapped each tile).
    uint64_t kt_desc = k_desc, kn_desc = pe_wg::desc_add(k_desc, stage_desc);
    uint64_t vt_desc = v_desc, vn_desc = pe_wg::desc_add(v_desc, stage_desc);
    for (int i = 0; i < ntiles; ++i) {
      const int t = w.t_begin + i;
      const bool at_range_end = to_range_end == 1;  // tile t ends its range
      const bool range_end = walk && i + 1 < ntiles && at_range_end;  // a range ends here, not the last
      if (i > 0) named_sync(kBarKReady);  // tile i landed
      float s[32];
#pragma unroll
      for (int k = 0; k < 32; ++k) s[k] = 0.f;
      pe_wg::fence_operands(s);
      pe_wg::begin();
#pragma unroll
      for (int ks = 0; ks < kDqk / 16; ++ks) {
        const uint64_t step = pe_wg::step_desc(pe_wg::slab_col(16 * ks, 64));  // the same in Q and K (64 rows)
        pe_wg::mma_nk64<T>(s, pe_wg::desc_add(q_desc, step), pe_wg::desc_add(kt_desc, step));
      }
      pe_wg::commit();
      if (pv_pending) {  // P V of tile i - 1 ran before S(i) on the tensor cores: its stage is free
        pe_wg::wait_pending<1>();
        pe_wg::fence_operands(o);
        if (i + 1 < ntiles) named_arrive(kBarKFree);
        pv_pending = false;
      }
      pe_wg::wait();
      pe_wg::fence_operands(s);

      float alpha[2];
      online_softmax_tile(s, t * kN, q, lim, qscale, mx, ls, alpha);
#pragma unroll
      for (int j = 0; j < 2; ++j)
        if (alpha[j] != 1.f) {
#pragma unroll
          for (int nt = 0; nt < 32; ++nt) o[4 * nt + 2 * j] *= alpha[j], o[4 * nt + 2 * j + 1] *= alpha[j];
        }
      // P as the A fragments of this warpgroup's P V (the S accumulator of keys 16 kk .. + 15 is the
      // A fragment of k-step kk): its products start now; warpgroup 1 reads P from shared memory.
      uint32_t pa[4][4];
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
#pragma unroll
        for (int e = 0; e < 4; ++e) pa[kk][e] = pack2<T>(s[8 * kk + 2 * e], s[8 * kk + 2 * e + 1]);
      pe_wg::fence_operands(o);
      pe_wg::begin();
#pragma unroll
      for (int kk = 0; kk < kN / 16; ++kk)
        pe_wg::mma_kn256_rs<T>(o, pa[kk], pe_wg::desc_add(vt_desc, pe_wg::step_desc(16 * kk * 64)));
      pe_wg::commit();  // left in flight while the next tile's S is issued, unless a range ends here
      pv_pending = true;
      float L[2];  // a range's row sums over the quad (the same reduction as after the loop)
      if (range_end) {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          float l = ls[j];
          l += pe_shfl_xor(l, 1);
          l += pe_shfl_xor(l, 2);
          L[j] = l;
          if (q == 0) sSum[range_par * kM + r[j]] = l, sMx[range_par * kM + r[j]] = mx[j];
        }
      }
      if (i > 0) named_sync(kBarPFree);  // warpgroup 1 is done with P(i - 1)
#pragma unroll
      for (int j = 0; j < 2; ++j) {
#pragma unroll
        for (int nt = 0; nt < 8; ++nt)  // s[4 nt + 2 j + e] is in pa[nt / 2][2 (nt % 2) + j]
          *reinterpret_cast<uint32_t*>(sP + slab_off(r[j], 8 * nt + 2 * q, kM)) = pa[nt >> 1][2 * (nt & 1) + j];
        if (q == 0) sScale[r[j]] = alpha[j];
      }
      pe_wg::fence_smem_for_async_reads();
      named_sync(kBarPReady);
      if (range_end) {
        pe_wg::wait();
        pe_wg::fence_operands(o);
        if (i + 2 < ntiles) named_arrive(kBarKFree);  // stage i & 1 may be refilled
        pv_pending = false;
        fold(L, mx, false);
        __syncwarp();  // converged again before the next tile's wgmma (.aligned)
#pragma unroll
        for (int k = 0; k < 128; ++k) o[k] = 0.f;
        mx[0] = mx[1] = neg_inf();
        ls[0] = ls[1] = 0.f;
      }
      next_tile(at_range_end);
      const uint64_t k_swap = kt_desc, v_swap = vt_desc;
      kt_desc = kn_desc, kn_desc = k_swap;
      vt_desc = vn_desc, vn_desc = v_swap;
    }
    pe_wg::wait();
    pe_wg::fence_operands(o);
    // Row sums over the quad; warpgroup 1 reads them (and the maxima) after the barrier below.
    const int par = ntiles > 0 ? ((w.t_end - 1) / tpr) & 1 : 0;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      float l = ls[j];
      l += pe_shfl_xor(l, 1);
      l += pe_shfl_xor(l, 2);
      ls[j] = l;
      if (q == 0) sSum[par * kM + r[j]] = l, sMx[par * kM + r[j]] = mx[j];
    }
  } else {
    for (int i = 0; i < ntiles; ++i) {
      const bool at_range_end = to_range_end == 1;
      const bool range_end = walk && i + 1 < ntiles && at_range_end;
      named_sync(kBarPReady);  // P(i) and the rescale factors written
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const float a = sScale[r[j]];
        if (a != 1.f) {
#pragma unroll
          for (int nt = 0; nt < 32; ++nt) o[4 * nt + 2 * j] *= a, o[4 * nt + 2 * j + 1] *= a;
        }
      }
      pe_wg::fence_operands(o);
      pe_wg::begin();
#pragma unroll
      for (int kk = 0; kk < kN / 16; ++kk)
        pe_wg::mma_kn256<T>(o, pe_wg::desc_add(p_desc, pe_wg::step_desc(16 * kk)),
                            pe_wg::desc_add(v_desc, stage_desc * (i & 1) + pe_wg::step_desc(16 * kk * 64)));
      pe_wg::commit();
      if (i + 1 < ntiles) {  // while the products run: publish tile i + 1 (issued two tiles ago)
        copy_wait<0>();
        pe_wg::fence_smem_for_async_reads();
        named_arrive(kBarKReady);
      }
      pe_wg::wait();
      pe_wg::fence_operands(o);
      if (i + 1 < ntiles) named_arrive(kBarPFree);
      if (i + 2 < ntiles) {
        named_sync(kBarKFree);  // warpgroup 0 is done with tile i: refill its stage with tile i + 2
        issue(i + 2, nblk);
        load_blocks(i + 3, nblk);
      }
      if (range_end) {  // warpgroup 0 wrote the range's sums before P_READY(i)
        const float L[2] = {sSum[range_par * kM + r[0]], sSum[range_par * kM + r[1]]};
        const float M[2] = {sMx[range_par * kM + r[0]], sMx[range_par * kM + r[1]]};
        fold(L, M, false);
        __syncwarp();  // converged again before the next tile's wgmma (.aligned)
#pragma unroll
        for (int k = 0; k < 128; ++k) o[k] = 0.f;
      }
      next_tile(at_range_end);
    }
  }
  copy_wait<0>();
  __syncthreads();

  const int par = ntiles > 0 ? ((w.t_end - 1) / tpr) & 1 : 0;
  const float L[2] = {sSum[par * kM + r[0]], sSum[par * kM + r[1]]};
  const float M[2] = {sMx[par * kM + r[0]], sMx[par * kM + r[1]]};
  if (walk) {
    fold(L, M, true);
    if (use_slab) {
      __syncthreads();  // every slab read of the block is done: drop the lines, then free the slab
      discard_slab(slab, tid);
      __threadfence();
      __syncthreads();
      if (tid == 0) release_slab(p, slot);
    }
    return;
  }
#pragma unroll
  for (int j = 0; j < 2; ++j) {  // a split block: the range's partial to the workspace (the combine merges)
    const int m = w.m_begin + r[j];
    if (m >= w.m_count) continue;
    const int i_tok = m / Hq;
    const int h = m - i_tok * Hq;
    const float inv = inverse_sum(L[j]);
    const int64_t ws = ((int64_t)(p.ws_start[w.row] + i_tok) * Hq + h) * p.max_splits + w.split;
    float* dst = p.ws_out + ws * kDv + col0;
#pragma unroll
    for (int nt = 0; nt < 32; ++nt)
      *reinterpret_cast<float2*>(dst + 8 * nt) = make_float2(o[4 * nt + 2 * j] * inv, o[4 * nt + 2 * j + 1] * inv);
    if (wg == 0 && q == 0) p.ws_lse[ws] = partial_lse(M[j], L[j]);
  }
}

}  // namespace

int launch_mla_fast(const PagedAttentionParams& p, peStream_t s) {
  using C = FastTile;
  return launch_mla_grid(p.dtype == PE_FLOAT16 ? &mla_fast_kernel<pe_half> : &mla_fast_kernel<pe_bf16>, C::kM,
                         C::kThreads, C::kSmemBytes, p, s);
}
#endif  // !PE_HIP
