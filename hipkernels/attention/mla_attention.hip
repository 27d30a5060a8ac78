// Paged MLA attention on tensor cores (semantics: mla_attention.h). Two kernels:
//   mla_attention_ws_kernel (NVIDIA, FastTile of mla_tile.h: wgmma, ~226 KB of shared memory): the two
//     warpgroups take different roles (S + softmax + half of P V / key copies + the other half of
//     P V), see its comment below;
//   mla_attention_kernel (SmallTile: 57.5 KB, FMA products; always under hipcc, on NVIDIA with
//     p.mla_small_tile): a generic body whose groups are symmetric, described here.
//
// Why a kernel of its own: per cached token MLA does ~128 x (576 + 512) x 2 flops for 1152 bytes of
// KV (~240 flop/byte), so the work must run on tensor cores and each KV tile must be loaded once for
// a large group of query heads. One block per (row, key split, tile of kM query-head pairs
// m = i * Hq + h); the tile's queries stay in shared memory for the whole split, and the keys stream
// through shared memory (cp.async) in tiles of kN keys. Group wg computes, for all kM pairs,
//   S = Q K^T   over keys kNS wg .. +kNS of the tile and all 576 dims
//   softmax     online, fp32, base 2; the key ranges of a row meet through shared memory (row max)
//   O += P V    value columns kNO wg .. +kNO (V = the first 512 dims of the keys), P passed through
//               shared memory as 16-bit values (as FlashAttention/FlashMLA do)
// so a thread owns the same two rows in S and in O. Per tile: 3 barriers (tile landed / row maxima
// written / P written). In both kernels the block layout and the arithmetic of a pair depend only on
// the model (Hq) and the row, never on the batch; the key split is the one of the GQA path
// (paged_attention.h), merged by the same combine kernel.
#include "common/hip_compat.h"
#include "attention/paged_attention.h"
#include "attention/attention_common.h"
#include "attention/mla_attention.h"
#include "attention/mla_tile.h"
#include "common/wgmma_tile.h"

#include <math.h>

namespace {

using namespace pe_attn;
using pe_wg::slab_off;

using namespace pe_mla;


template <typename T, typename C>
__global__ void __launch_bounds__(C::kThreads, 1) mla_attention_kernel(PagedAttentionParams p) {
  constexpr int kM = C::kM, kN = C::kN, kNS = C::kNS, kNO = C::kNO, kS = kNS / 2, kO = kNO / 2;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* smem = smem_raw + pe_wg::align_1024(smem_raw);
  T* sQ = reinterpret_cast<T*>(smem);                      // [kM][576] slab tile
  T* sK = sQ + C::kQElems;                                 // [kStages][kN][576] slab tiles
  T* sP = sK + C::kStages * C::kKElems;                    // [kM][kN] slab tile
  float* sMax = reinterpret_cast<float*>(sP + C::kPElems); // [kGroups key ranges][kM]
  float* sSum = sMax + C::kGroups * kM;                    // [kGroups key ranges][kM]

  const int Hq = p.num_q_heads;
  const int row = blockIdx.z;
  const int q0 = p.query_start_loc[row];
  const int q_len = p.query_start_loc[row + 1] - q0;
  const int ctx = p.context_lens[row];
  const int m_begin = blockIdx.x * kM;
  const int m_count = q_len * Hq;
  if (m_begin >= m_count) return;
  int nsplit, split_size;
  row_splits(ctx, q_len, p.split_block, &nsplit, &split_size);
  const int split = blockIdx.y;
  if (split >= nsplit) return;
  const int m_last = min(m_begin + kM, m_count) - 1;
  const int k_begin = split * split_size;
  const int k_split_end = min(ctx, k_begin + split_size);
  const int k_end = min(k_split_end, ctx - (q_len - 1 - m_last / Hq));  // no pair of the tile sees more
  const int ntiles = k_end > k_begin ? (k_end - k_begin + kN - 1) / kN : 0;

  const int tid = threadIdx.x;

  // Copies: kTpr threads per key, thread sub copies chunks sub, sub + kTpr, ...
  constexpr int kTpr = C::kTpr, kTprQ = C::kTprQ;
  const int my_row = tid / kTpr;
  const int sub = tid - my_row * kTpr;
  const T* kcache = static_cast<const T*>(p.k_cache);
  const int32_t* btab = p.block_tables + (int64_t)row * p.max_blocks_per_row;
  const int bs = p.block_size;
  const bool bs_pow2 = (bs & (bs - 1)) == 0;
  const int bs_shift = __ffs(bs) - 1;
  auto load_block = [&](int t) -> int {  // block of this thread's key of tile t; -1: not a key
    const int key = k_begin + t * kN + my_row;
    if (t >= ntiles || key >= k_end) return -1;
    return btab[bs_pow2 ? key >> bs_shift : key / bs];
  };
  auto issue = [&](int t, int blk) {  // zero-fill outside [k_begin, k_end): unused pages are never read
    if (t < ntiles) {
      const int key = k_begin + t * kN + my_row;
      const int within = bs_pow2 ? key & (bs - 1) : key - (key / bs) * bs;
      const T* src = kcache + (blk >= 0 ? ((int64_t)blk * bs + within) * kDqk : 0);
      T* dst = sK + (C::kStages == 2 ? t & 1 : 0) * C::kKElems;
#pragma unroll
      for (int i = 0; i < kChunks / kTpr; ++i) {
        const int c = (sub + kTpr * i) * 8;
        copy16_async(dst + slab_off(my_row, c, kN), src + c, blk >= 0);
      }
    }
    copy_commit();
  };
  {  // the tile's queries (kTprQ threads per row), in the same copy group as the first key tile
    const int q_row = tid / kTprQ, q_sub = tid - q_row * kTprQ;
    const int m = m_begin + q_row;
    const bool valid = m < m_count;
    const int i = valid ? m / Hq : 0;
    const T* src = static_cast<const T*>(p.q) + (int64_t)(q0 + i) * p.q_stride_token +
                   (int64_t)(valid ? m - i * Hq : 0) * p.q_stride_head;
#pragma unroll
    for (int j = 0; j < kChunks / kTprQ; ++j) {
      const int c = (q_sub + kTprQ * j) * 8;
      copy16_async(sQ + slab_off(q_row, c, kM), src + c, valid);
    }
  }
  issue(0, load_block(0));
  int nblk = load_block(1);

  // This thread's rows (the same in S and O): r[j] = 16 (warp % kWarps) + g + 8 j; its group wg
  // owns keys kNS wg .. +kNS of each tile in S and value columns kNO wg .. +kNO in O.
  const int warp = tid >> 5, wg = warp / C::kWarps, lane = tid & 31, g = lane >> 2, q = lane & 3;
  int r[2], lim[2];
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    r[j] = 16 * (warp % C::kWarps) + g + 8 * j;
    const int m = m_begin + r[j];
    lim[j] = m < m_count ? min(k_split_end, ctx - (q_len - 1 - m / Hq)) : k_begin;  // keys < lim
  }
  const float qscale = p.scale * kLog2e;

  // Running max mx and this lane's partial sum ls per row; o: the wgmma accumulator layout.
  float mx[2] = {neg_inf(), neg_inf()}, ls[2] = {0.f, 0.f}, o[kO];
#pragma unroll
  for (int i = 0; i < kO; ++i) o[i] = 0.f;

  for (int t = 0; t < ntiles; ++t) {
    copy_wait<0>();  // tile t (and at t = 0 the queries) landed, this thread's copies ...
    __syncthreads();  // ... everyone's; everyone is done with tile t - 1, whose stage is refilled now
    if constexpr (C::kStages > 1) {
      issue(t + 1, nblk);
      nblk = load_block(t + 2);
    }
    const T* kt = sK + (C::kStages == 2 ? t & 1 : 0) * C::kKElems;

    // FMA products, one call at a time: unrolled, hipcc would hoist the shared-memory loads of all
    // of them and spill (~1 KB of scratch per lane on gfx90a).
    float s[kS];
#pragma unroll
    for (int i = 0; i < kS; ++i) s[i] = 0.f;
#pragma unroll 1
    for (int ks = 0; ks < kDqk / 16; ++ks)
      pe_wg::product_nk<T, kNS, C::kWarps, false>(s, sQ, kM, 0, 16 * ks, kt, kN, kNS * wg, 16 * ks);

    // Scale into the base-2 domain, mask, and publish this group's row maxima.
    const int key0 = k_begin + t * kN + kNS * wg + 2 * q;
    float hmax[2] = {neg_inf(), neg_inf()};
#pragma unroll
    for (int i = 0; i < kS; ++i) {
      const int j = (i >> 1) & 1;
      s[i] = key0 + 8 * (i >> 2) + (i & 1) < lim[j] ? s[i] * qscale : neg_inf();
      hmax[j] = fmaxf(hmax[j], s[i]);
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
    if constexpr (C::kStages == 1) {  // one stage: refill it once everyone is done with tile t
      __syncthreads();
      issue(t + 1, nblk);
      nblk = load_block(t + 2);
    }
  }
  copy_wait<0>();

  // Row sums: this lane's keys -> the group's key range -> all groups.
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    float l = ls[j];
    l += pe_shfl_xor(l, 1);
    l += pe_shfl_xor(l, 2);
    if (q == 0) sSum[wg * kM + r[j]] = l;
  }
  __syncthreads();

  const bool direct = nsplit == 1;
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int m = m_begin + r[j];
    if (m >= m_count) continue;
    const int i_tok = m / Hq;
    const int h = m - i_tok * Hq;
    float L = sSum[r[j]];  // in group order: the same sum whatever the row's position in the batch
#pragma unroll
    for (int gi = 1; gi < C::kGroups; ++gi) L += sSum[gi * kM + r[j]];
    const float inv = L > 0.f ? 1.f / L : 0.f;
    const int col = kNO * wg + 2 * q;
    const int tok = q0 + i_tok;
    if (direct) {
      T* dst = static_cast<T*>(p.out) + (int64_t)tok * p.out_stride_token + (int64_t)h * p.out_stride_head + col;
#pragma unroll
      for (int nt = 0; nt < kNO / 8; ++nt)
        *reinterpret_cast<uint32_t*>(dst + 8 * nt) = pack2<T>(o[4 * nt + 2 * j] * inv, o[4 * nt + 2 * j + 1] * inv);
      if (wg == 0 && q == 0 && p.lse != nullptr) p.lse[(int64_t)tok * Hq + h] = L > 0.f ? (mx[j] + log2f(L)) * kLn2 : pos_inf();
    } else {
      const int64_t w = ((int64_t)(p.ws_start[row] + i_tok) * Hq + h) * p.max_splits + split;
      float* dst = p.ws_out + w * kDv + col;
#pragma unroll
      for (int nt = 0; nt < kNO / 8; ++nt)
        *reinterpret_cast<float2*>(dst + 8 * nt) = make_float2(o[4 * nt + 2 * j] * inv, o[4 * nt + 2 * j + 1] * inv);
      if (wg == 0 && q == 0) p.ws_lse[w] = L > 0.f ? mx[j] + log2f(L) : neg_inf();
    }
  }
}

#if !defined(PE_HIP)
// The fast tile on NVIDIA: the same tiles and shared memory as FastTile, but the two warpgroups take
// different roles (as FlashMLA does), so that the tensor cores rarely wait:
//   warpgroup 0: S = Q K^T for all 64 keys of the tile (m64n64k16 x 36: a third less shared-memory
//                traffic than two m64n32 streams), the whole online softmax in registers (a row's 64
//                keys sit in one quad of lanes: no row-max exchange), P and the rescale factor of each
//                row into shared memory, then O[:, 0:256] += P V.
//   warpgroup 1: issues the key-tile copies (two tiles ahead of the one in use), and
//                O[:, 256:512] += P V, running while warpgroup 0 computes S of the next tile.
// Named barriers (ids 1-4, 256 threads; __syncthreads is id 0) hand over: tile t landed (K_READY),
// P(t) written (P_READY), P read (P_FREE), key stage of tile t free (K_FREE). Results are those of the
// shared kernel body up to fp32 summation order; the split rule and workspace are the same.
// barrier.sync / barrier.arrive, not bar.sync / bar.arrive: those are the .aligned forms, which every
// lane of a warp must execute together, and compute-sanitizer synccheck reports divergent lanes at
// them in this kernel (the hand-overs follow per-row branches and one-lane-of-four stores). The
// non-aligned forms have no such requirement and measured the same speed.
PE_DEVICE void named_sync(int id) { asm volatile("barrier.sync %0, 256;\n" ::"r"(id) : "memory"); }
PE_DEVICE void named_arrive(int id) { asm volatile("barrier.arrive %0, 256;\n" ::"r"(id) : "memory"); }
constexpr int kBarKReady = 1, kBarPReady = 2, kBarPFree = 3, kBarKFree = 4;

template <typename T>
__global__ void __launch_bounds__(256, 1) mla_attention_ws_kernel(PagedAttentionParams p) {
  using C = FastTile;
  constexpr int kM = C::kM, kN = C::kN;
  static_assert(kM == 64 && kN == 64 && C::kThreads == 256 && C::kStages == 2, "two warpgroups, 64 x 64 tiles");
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* smem = smem_raw + pe_wg::align_1024(smem_raw);
  T* sQ = reinterpret_cast<T*>(smem);                        // [kM][576] slab tile
  T* sK = sQ + C::kQElems;                                   // [2][kN][576] slab tiles
  T* sP = sK + 2 * C::kKElems;                               // [kM][kN] slab tile
  float* sScale = reinterpret_cast<float*>(sP + C::kPElems); // [kM] rescale factor of O for tile t
  float* sSum = sScale + kM;                                 // [kM] final row sums
  float* sMx = sSum + kM;                                    // [kM] final row maxima

  const int Hq = p.num_q_heads;
  const int row = blockIdx.z;
  const int q0 = p.query_start_loc[row];
  const int q_len = p.query_start_loc[row + 1] - q0;
  const int ctx = p.context_lens[row];
  const int m_begin = blockIdx.x * kM;
  const int m_count = q_len * Hq;
  if (m_begin >= m_count) return;
  int nsplit, split_size;
  row_splits(ctx, q_len, p.split_block, &nsplit, &split_size);
  const int split = blockIdx.y;
  if (split >= nsplit) return;
  const int m_last = min(m_begin + kM, m_count) - 1;
  const int k_begin = split * split_size;
  const int k_split_end = min(ctx, k_begin + split_size);
  const int k_end = min(k_split_end, ctx - (q_len - 1 - m_last / Hq));
  const int ntiles = k_end > k_begin ? (k_end - k_begin + kN - 1) / kN : 0;

  const int tid = threadIdx.x;
  const int warp = tid >> 5, wg = warp >> 2, lane = tid & 31, g = lane >> 2, q = lane & 3;
  const T* kcache = static_cast<const T*>(p.k_cache);
  const int32_t* btab = p.block_tables + (int64_t)row * p.max_blocks_per_row;
  const int bs = p.block_size;
  const bool bs_pow2 = (bs & (bs - 1)) == 0;
  const int bs_shift = __ffs(bs) - 1;
  // Key copies (warpgroup 1): 8 threads per 128-byte line of a key, so that one copy instruction of
  // a warp reads 4 whole lines (2 threads per key, 32 bytes each, was 4x the L2 requests per byte);
  // thread (key kc, chunk cc) copies chunks cc, cc + 8, ... of keys kc, kc + 16, kc + 32, kc + 48.
  const int kc = (tid & 127) >> 3, cc = tid & 7;
  auto load_blocks = [&](int t, int (&blk)[4]) {  // blocks of this thread's keys of tile t; -1: not a key
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int key = k_begin + t * kN + kc + 16 * u;
      blk[u] = t < ntiles && key < k_end ? btab[bs_pow2 ? key >> bs_shift : key / bs] : -1;
    }
  };
  auto issue = [&](int t, const int (&blk)[4]) {  // zero-fill outside [k_begin, k_end): unused pages are never read
    if (t < ntiles) {
      T* dst = sK + (t & 1) * C::kKElems;
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int key = k_begin + t * kN + kc + 16 * u;
        const int within = bs_pow2 ? key & (bs - 1) : key - (key / bs) * bs;
        const T* src = kcache + (blk[u] >= 0 ? ((int64_t)blk[u] * bs + within) * kDqk : 0);
#pragma unroll
        for (int i = 0; i < kChunks / 8; ++i) {
          const int c = (cc + 8 * i) * 8;
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
      const int m = m_begin + q_row;
      const bool valid = m < m_count;
      const int i = valid ? m / Hq : 0;
      const T* src = static_cast<const T*>(p.q) + (int64_t)(q0 + i) * p.q_stride_token +
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
  pe_wg::fence_smem_for_async_reads();
  __syncthreads();

  // This thread's rows (the same in S and O): r[j] = 16 (warp % 4) + g + 8 j.
  int r[2];
#pragma unroll
  for (int j = 0; j < 2; ++j) r[j] = 16 * (warp & 3) + g + 8 * j;
  float o[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) o[i] = 0.f;
  float mx[2] = {neg_inf(), neg_inf()}, ls[2] = {0.f, 0.f};

  if (wg == 0) {
    int lim[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int m = m_begin + r[j];
      lim[j] = m < m_count ? min(k_split_end, ctx - (q_len - 1 - m / Hq)) : k_begin;  // keys < lim
    }
    const float qscale = p.scale * kLog2e;
    for (int t = 0; t < ntiles; ++t) {
      if (t > 0) named_sync(kBarKReady);  // tile t landed
      const T* kt = sK + (t & 1) * C::kKElems;
      float s[32];
#pragma unroll
      for (int i = 0; i < 32; ++i) s[i] = 0.f;
      pe_wg::fence_operands(s);
      pe_wg::begin();
#pragma unroll
      for (int ks = 0; ks < kDqk / 16; ++ks)
        pe_wg::product_nk<T, 64>(s, sQ, kM, 0, 16 * ks, kt, kN, 0, 16 * ks);
      pe_wg::end();
      pe_wg::fence_operands(s);

      const int key0 = k_begin + t * kN + 2 * q;
      float alpha[2];
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        float hmax = neg_inf();
#pragma unroll
        for (int nt = 0; nt < 8; ++nt)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float& v = s[4 * nt + 2 * j + e];
            v = key0 + 8 * nt + e < lim[j] ? v * qscale : neg_inf();
            hmax = fmaxf(hmax, v);
          }
        hmax = fmaxf(hmax, pe_shfl_xor(hmax, 1));
        hmax = fmaxf(hmax, pe_shfl_xor(hmax, 2));
        const float mn = fmaxf(mx[j], hmax);
        alpha[j] = 1.f;
        if (mn != mx[j]) {
          alpha[j] = exp2f(mx[j] - mn);  // 0 when the old max was -inf (o and ls are 0 then)
          ls[j] *= alpha[j];
#pragma unroll
          for (int nt = 0; nt < 32; ++nt) o[4 * nt + 2 * j] *= alpha[j], o[4 * nt + 2 * j + 1] *= alpha[j];
          mx[j] = mn;
        }
        const float ref = mn == neg_inf() ? 0.f : mn;  // a row with no key yet: all P are 0
#pragma unroll
        for (int i = 0; i < 16; ++i) {
          float& v = s[4 * (i >> 1) + 2 * j + (i & 1)];
          v = exp2f(v - ref);
          ls[j] += v;
        }
      }
      if (t > 0) named_sync(kBarPFree);  // warpgroup 1 is done with P(t - 1)
#pragma unroll
      for (int j = 0; j < 2; ++j) {
#pragma unroll
        for (int nt = 0; nt < 8; ++nt)
          *reinterpret_cast<uint32_t*>(sP + slab_off(r[j], 8 * nt + 2 * q, kM)) =
              pack2<T>(s[4 * nt + 2 * j], s[4 * nt + 2 * j + 1]);
        if (q == 0) sScale[r[j]] = alpha[j];
      }
      pe_wg::fence_smem_for_async_reads();
      named_sync(kBarPReady);

      const T* kv = kt;
      pe_wg::fence_operands(o);
      pe_wg::begin();
#pragma unroll
      for (int kk = 0; kk < kN / 16; ++kk) pe_wg::product_kn<T, 256>(o, sP, kM, 0, 16 * kk, kv, kN, 16 * kk, 0);
      pe_wg::end();
      pe_wg::fence_operands(o);
      if (t + 2 < ntiles) named_arrive(kBarKFree);  // stage t & 1 may be refilled
    }
    // Row sums over the quad; warpgroup 1 reads them (and the maxima) after the barrier below.
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      float l = ls[j];
      l += pe_shfl_xor(l, 1);
      l += pe_shfl_xor(l, 2);
      ls[j] = l;
      if (q == 0) sSum[r[j]] = l, sMx[r[j]] = mx[j];
    }
  } else {
    for (int t = 0; t < ntiles; ++t) {
      named_sync(kBarPReady);  // P(t) and the rescale factors written
      const T* kt = sK + (t & 1) * C::kKElems;
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
      for (int kk = 0; kk < kN / 16; ++kk) pe_wg::product_kn<T, 256>(o, sP, kM, 0, 16 * kk, kt, kN, 16 * kk, 256);
      pe_wg::commit();
      if (t + 1 < ntiles) {  // while the products run: publish tile t + 1 (issued two tiles ago)
        copy_wait<0>();
        pe_wg::fence_smem_for_async_reads();
        named_arrive(kBarKReady);
      }
      pe_wg::wait();
      pe_wg::fence_operands(o);
      if (t + 1 < ntiles) named_arrive(kBarPFree);
      if (t + 2 < ntiles) {
        named_sync(kBarKFree);  // warpgroup 0 is done with tile t: refill its stage with tile t + 2
        issue(t + 2, nblk);
        load_blocks(t + 3, nblk);
      }
    }
  }
  copy_wait<0>();
  __syncthreads();

  const bool direct = nsplit == 1;
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int m = m_begin + r[j];
    if (m >= m_count) continue;
    const int i_tok = m / Hq;
    const int h = m - i_tok * Hq;
    const float L = sSum[r[j]];
    const float M = sMx[r[j]];
    const float inv = L > 0.f ? 1.f / L : 0.f;
    const int col = 256 * wg + 2 * q;
    const int tok = q0 + i_tok;
    if (direct) {
      T* dst = static_cast<T*>(p.out) + (int64_t)tok * p.out_stride_token + (int64_t)h * p.out_stride_head + col;
#pragma unroll
      for (int nt = 0; nt < 32; ++nt)
        *reinterpret_cast<uint32_t*>(dst + 8 * nt) = pack2<T>(o[4 * nt + 2 * j] * inv, o[4 * nt + 2 * j + 1] * inv);
      if (wg == 0 && q == 0 && p.lse != nullptr) p.lse[(int64_t)tok * Hq + h] = L > 0.f ? (M + log2f(L)) * kLn2 : pos_inf();
    } else {
      const int64_t w = ((int64_t)(p.ws_start[row] + i_tok) * Hq + h) * p.max_splits + split;
      float* dst = p.ws_out + w * kDv + col;
#pragma unroll
      for (int nt = 0; nt < 32; ++nt)
        *reinterpret_cast<float2*>(dst + 8 * nt) = make_float2(o[4 * nt + 2 * j] * inv, o[4 * nt + 2 * j + 1] * inv);
      if (wg == 0 && q == 0) p.ws_lse[w] = L > 0.f ? M + log2f(L) : neg_inf();
    }
  }
}
#endif  // !PE_HIP

template <typename C>
int launch_kernel(void (*kernel)(PagedAttentionParams), const PagedAttentionParams& p, peStream_t s) {
  const void* fn = reinterpret_cast<const void*>(kernel);
#if defined(PE_HIP)
  peError_t rc = hipFuncSetAttribute(fn, hipFuncAttributeMaxDynamicSharedMemorySize, C::kSmemBytes);
#else
  peError_t rc = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmemBytes);
#endif
  if (rc != peSuccess) return static_cast<int>(rc);
  const int m_tiles = (p.max_query_len * p.num_q_heads + C::kM - 1) / C::kM;
  // Pair tiles fastest: the tiles of one (row, split) run side by side and share its keys in L2.
  const dim3 grid((unsigned)m_tiles, (unsigned)p.max_splits, (unsigned)p.num_rows);
  kernel<<<grid, C::kThreads, C::kSmemBytes, s>>>(p);
  return 0;
}

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
  return optin < FastTile::kSmemBytes;
}
#endif

template <typename T>
int launch_tile(const PagedAttentionParams& p, peStream_t s) {
#if !defined(PE_HIP)
  if (!use_small_tile(p)) return launch_kernel<FastTile>(&mla_attention_ws_kernel<T>, p, s);
#endif
  return launch_kernel<SmallTile>(&mla_attention_kernel<T, SmallTile>, p, s);
}

}  // namespace

int launch_mla_attention(const PagedAttentionParams& p, void* stream) {
  if (p.num_rows == 0 || p.max_query_len == 0) return 0;
  if (p.num_kv_heads != 1 || p.head_dim_qk != kDqk || p.head_dim_v != kDv || p.num_q_heads <= 0 ||
      p.max_splits < 1 || p.split_block < 64 || p.split_block % 64 != 0)
    return -1;
  const peStream_t s = static_cast<peStream_t>(stream);
  int rc;
  if (p.dtype == PE_FLOAT16) rc = launch_tile<pe_half>(p, s);
  else if (p.dtype == PE_BFLOAT16) rc = launch_tile<pe_bf16>(p, s);
  else rc = -1;
  if (rc != 0) return rc;
  rc = static_cast<int>(peGetLastError());
  if (rc != 0) return rc;
  return launch_paged_attention_combine(p, stream);
}
