// Paged MLA attention on tensor cores (semantics: mla_attention.h). The description below is the
// fast configuration (FastTile of mla_tile.h); the small one (SmallTile: 64 KB of shared memory, FMA
// products) is the same body with smaller tiles: 16 pairs, 4 one-warp groups, 1 stage of 32 keys.
//
// Why a kernel of its own: per cached token MLA does ~128 x (576 + 512) x 2 flops for 1152 bytes of
// KV (~240 flop/byte), so the work must run on tensor cores and each KV tile must be loaded once for
// a large group of query heads. One block of two warpgroups (256 threads) per (row, key split, tile
// of kM = 64 query-head pairs m = i * Hq + h); the tile's queries stay in shared memory for the whole
// split, and the keys stream through a two-stage shared-memory pipeline (cp.async) in tiles of
// kN = 64. Warpgroup wg computes, for all 64 pairs,
//   S = Q K^T   over keys 32 wg .. +32 of the tile and all 576 dims (wgmma m64n32k16 x 36)
//   softmax     online, fp32, base 2; the two key halves of a row meet through shared memory (row max)
//   O += P V    value columns 256 wg .. +256 (V = the first 512 dims of the keys; wgmma m64n256k16
//               x 4), P passed through shared memory as 16-bit values (as FlashAttention/FlashMLA do)
// so a thread owns the same two rows in S and in O. Per tile: 3 barriers (tile landed / row maxima
// written / P written). The block layout and the arithmetic of a pair depend only on the model (Hq)
// and the row, never on the batch; the key split is the one of the GQA path (paged_attention.h),
// merged by the same combine kernel.
#include "hip_compat.h"
#include "paged_attention.h"
#include "attention_common.h"
#include "mla_attention.h"
#include "mla_tile.h"
#include "wgmma_tile.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

namespace {

using namespace pe_attn;
using pe_wg::slab_off;

using namespace pe_mla;

// Two floats -> one 32-bit pair of T (lower index in the lower half), one rounding each.
template <typename T>
PE_DEVICE uint32_t pack2(float lo, float hi) {
  return PeVec8<T>::from_float(lo) | ((uint32_t)PeVec8<T>::from_float(hi) << 16);
}

template <typename T, typename C>
__global__ void __launch_bounds__(C::kThreads, 1) mla_attention_kernel(PagedAttentionParams p) {
  constexpr int kM = C::kM, kN = C::kN, kNS = C::kNS, kNO = C::kNO, kS = kNS / 2, kO = kNO / 2;
  constexpr bool kTC = C::kTensor;
  // FMA products are not unrolled across calls: hipcc would hoist the shared-memory loads of all of
  // them and spill (~1 KB of scratch per lane on gfx90a); one call at a time needs no scratch.
  constexpr int kUnrollS = kTC ? kDqk / 16 : 1, kUnrollO = kTC ? kN / 16 : 1;
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
    pe_wg::fence_smem_for_async_reads<kTC>();
    __syncthreads();  // ... everyone's; everyone is done with tile t - 1, whose stage is refilled now
    if constexpr (C::kStages > 1) {
      issue(t + 1, nblk);
      nblk = load_block(t + 2);
    }
    const T* kt = sK + (C::kStages == 2 ? t & 1 : 0) * C::kKElems;

    float s[kS];
#pragma unroll
    for (int i = 0; i < kS; ++i) s[i] = 0.f;
    pe_wg::fence_operands<kTC>(s);
    pe_wg::begin<kTC>();
#pragma unroll kUnrollS
    for (int ks = 0; ks < kDqk / 16; ++ks)
      pe_wg::product_nk<T, kNS, C::kWarps, kTC>(s, sQ, kM, 0, 16 * ks, kt, kN, kNS * wg, 16 * ks);
    pe_wg::end<kTC>();
    pe_wg::fence_operands<kTC>(s);

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
    pe_wg::fence_smem_for_async_reads<kTC>();
    __syncthreads();

    pe_wg::fence_operands<kTC>(o);
    pe_wg::begin<kTC>();
#pragma unroll kUnrollO
    for (int kk = 0; kk < kN / 16; ++kk)
      pe_wg::product_kn<T, kNO, C::kWarps, kTC>(o, sP, kM, 0, 16 * kk, kt, kN, 16 * kk, kNO * wg);
    pe_wg::end<kTC>();
    pe_wg::fence_operands<kTC>(o);
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

template <typename T, typename C>
int launch_typed(const PagedAttentionParams& p, peStream_t s) {
  const void* fn = reinterpret_cast<const void*>(&mla_attention_kernel<T, C>);
#if defined(PE_HIP)
  peError_t rc = hipFuncSetAttribute(fn, hipFuncAttributeMaxDynamicSharedMemorySize, C::kSmemBytes);
#else
  peError_t rc = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmemBytes);
#endif
  if (rc != peSuccess) return static_cast<int>(rc);
  const int m_tiles = (p.max_query_len * p.num_q_heads + C::kM - 1) / C::kM;
  // Pair tiles fastest: the tiles of one (row, split) run side by side and share its keys in L2.
  const dim3 grid((unsigned)m_tiles, (unsigned)p.max_splits, (unsigned)p.num_rows);
  mla_attention_kernel<T, C><<<grid, C::kThreads, C::kSmemBytes, s>>>(p);
  return 0;
}

// The small tile: always under hipcc (the fast one is not even compiled there: its 226 KB never fit
// a gfx90a block); on NVIDIA when PYENGINE_MLA_SMALL_TILE is set to anything but "" / "0" (read at
// every launch, so tests can run both paths in one process) or when the device cannot give a block
// the fast tile's shared memory (builds for targets other than sm_90a).
#if defined(PE_HIP)
constexpr bool kFastTileBuilt = false;
bool use_small_tile() { return true; }
#else
constexpr bool kFastTileBuilt = true;
bool use_small_tile() {
  const char* env = getenv("PYENGINE_MLA_SMALL_TILE");
  if (env != nullptr && env[0] != '\0' && strcmp(env, "0") != 0) return true;
  int dev = 0, optin = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess)
    return false;  // let the launch report the error
  return optin < FastTile::kSmemBytes;
}
#endif

template <typename T>
int launch_tile(const PagedAttentionParams& p, peStream_t s) {
  if constexpr (kFastTileBuilt) {
    if (!use_small_tile()) return launch_typed<T, FastTile>(p, s);
  }
  return launch_typed<T, SmallTile>(p, s);
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
