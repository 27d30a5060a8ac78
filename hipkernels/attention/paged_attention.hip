// Paged GQA attention on the CUDA cores (decode, verify, prefill chunks and mixed batches in one
// launch); the split-KV combine that every attention kernel shares is paged_attention_combine.hip.
// Semantics and the split rule: paged_attention.h. This FMA kernel is what AMD runs; NVIDIA runs the tensor-core kernel
// of paged_attention_mma.hip (same semantics, split rule and workspace) unless p.gqa_fma asks for it.
//
// Work decomposition: one block of kThreads threads per (row, kv head, key split, tile of MT
// query-head pairs). The pairs of a row are m = i * G + g (query token i, head g of the KV group),
// so one block serves all query heads of a KV group (and several query tokens of a verify step)
// from a single pass over that group's keys. Threads form groups of LPT lanes; a group owns one
// key at a time, each lane a strided set of 16-byte vectors of it; U keys per group are loaded
// before any use so that several loads are in flight. Scores are reduced across the group with
// butterfly shuffles, the softmax is online (base-2, scores pre-scaled by log2(e)), and the groups
// are merged through shared memory at the end. All per-pair arithmetic is independent of the other
// pairs of the tile, so the tile size never changes a result.
#include "common/hip_compat.h"
#include "attention/paged_attention.h"
#include "attention/attention_common.h"

#include <math.h>

namespace {

using pe_attn::copy16_async;
using pe_attn::copy_commit;
using pe_attn::copy_wait;
using pe_attn::kLog2e;
using pe_attn::merge_and_store_pair;
using pe_attn::neg_inf;
using pe_attn::block_tile;
using pe_attn::gqa_grid;
using pe_attn::gqa_row_splits;
using pe_attn::walk_merge_pair;
using pe_attn::store8;

constexpr int kThreads = 128;

// Blocks per SM to ask the register allocator for: 3 (at most 168 registers) where the queries and
// accumulators of a thread need at most 128 registers per key in flight, else no cap (spills).
template <int DQK, int DV, int LPT, int MT, int U>
constexpr int kMinBlocks() {
  return ((DQK / 8 + LPT - 1) / LPT + (DV / 8 + LPT - 1) / LPT) * MT * 8 * U <= 128 ? 3 : 1;
}

// T: pe_half or pe_bf16. DQK/DV: head dims. LPT: lanes per key. MT: query-head pairs per block.
// U: keys per group per tile. STAGES: depth of the shared-memory K/V pipeline. (MLA, where V is a
// prefix of K and one latent head serves 128 query heads, has its own kernel: mla_attention.hip.)
//
// Keys are processed in tiles of KT = NG * U keys (NG = kThreads / LPT groups); the block copies
// tile t + STAGES - 1 into shared memory (cp.async) while it computes tile t from shared memory,
// with the block-table entries of the tile after that already loaded into registers, so that the
// memory system always has STAGES - 1 tiles of the block in flight whatever the arithmetic costs.
// Group g takes keys g, g + NG, ... of a tile; its LPT lanes split the head dim in 16-byte vectors.
// The arithmetic of a query-head pair depends only on (LPT, U, the row), never on MT or the batch.
template <typename T, int DQK, int DV, int LPT, int MT, int U, int STAGES>
__global__ void __launch_bounds__(kThreads, (kMinBlocks<DQK, DV, LPT, MT, U>())) paged_attention_kernel(PagedAttentionParams p) {
  // Launched with PDL (p.pdl): the block may start while the previous kernel finishes, and reads
  // nothing of the step before it has (a no-op for an ordinary launch).
  pe_pdl_wait();
  constexpr int NV_K = DQK / 8;                    // 16-byte vectors per K row
  constexpr int NV_V = DV / 8;
  constexpr int VPL_K = (NV_K + LPT - 1) / LPT;    // vectors per lane
  constexpr int VPL_V = (NV_V + LPT - 1) / LPT;
  constexpr int NG = kThreads / LPT;               // key groups per block
  constexpr int KT = NG * U;                       // keys per tile
  constexpr int TILE_ELEMS = KT * (DQK + DV);      // 16-bit elements per stage
  constexpr int PIPE_BYTES = STAGES * TILE_ELEMS * 2;
  constexpr int MERGE_BYTES = NG * MT * DV * 4;
  constexpr int SMEM_BYTES = PIPE_BYTES > MERGE_BYTES ? PIPE_BYTES : MERGE_BYTES;
  static_assert(DQK % 8 == 0 && DV % 8 == 0 && LPT <= 32 && (LPT & (LPT - 1)) == 0, "layout");
  static_assert(SMEM_BYTES + NG * MT * 8 <= 48 * 1024, "static shared memory");
  static_assert(STAGES >= 2, "pipeline");

  __shared__ float s_ml[NG][MT][2];
  __shared__ __align__(16) unsigned char s_raw[SMEM_BYTES];
  T* s_kv = reinterpret_cast<T*>(s_raw);                         // [STAGES][KT][DQK] then [STAGES][KT][DV]
  float (*s_acc)[MT][DV] = reinterpret_cast<float (*)[MT][DV]>(s_raw);  // after the key loop

  const int Hkv = p.num_kv_heads;
  const int Hq = p.num_q_heads;
  const int G = Hq / Hkv;
  int row, kvh, m_begin;
  if (!block_tile(p, MT, &row, &kvh, &m_begin)) return;
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
  const int group = tid / LPT;
  const int lane = tid - group * LPT;

  // Query-head pairs of this tile: token index, head, and key limit (exclusive) of each.
  int qi[MT], head[MT], lim[MT];
  bool mvalid[MT];
#pragma unroll
  for (int mm = 0; mm < MT; ++mm) {
    const int m = m_begin + mm;
    mvalid[mm] = m < m_count;
    qi[mm] = mvalid[mm] ? m / G : 0;
    head[mm] = kvh * G + (mvalid[mm] ? m - qi[mm] * G : 0);
    lim[mm] = mvalid[mm] ? ctx - (q_len - 1 - qi[mm]) : -1;
  }
  const int m_last = min(m_begin + MT, m_count) - 1;
  const int k_lim = ctx - (q_len - 1 - m_last / G);  // no pair of the tile sees more keys
  const int nranges = walk && k_lim > split_size ? (k_lim + split_size - 1) / split_size : 1;
  int k_begin = split * split_size;
  int k_end = min(min(ctx, k_begin + split_size), k_lim);
  int ntiles = k_end > k_begin ? (k_end - k_begin + KT - 1) / KT : 0;

  const T* kcache = static_cast<const T*>(p.k_cache);
  const T* vcache = static_cast<const T*>(p.v_cache);
  const int32_t* btab = p.block_tables + (int64_t)row * p.max_blocks_per_row;
  const int bs = p.block_size;
  const int64_t k_slot_stride = (int64_t)Hkv * DQK;
  const int64_t v_slot_stride = (int64_t)Hkv * DV;

  // Copy layout: TPK threads per key of a tile; thread tid copies 16-byte vectors sub, sub + TPK, ...
  // of the K row (then of the V row) of key tid / TPK, so it needs one block-table entry per tile.
  constexpr int TPK = kThreads / KT;
  static_assert(kThreads % KT == 0, "copy layout");
  constexpr int CV_K = (NV_K + TPK - 1) / TPK;
  constexpr int CV_V = (NV_V + TPK - 1) / TPK;
  const int my_kt = tid / TPK;
  const int sub = tid - my_kt * TPK;
  const bool bs_pow2 = (bs & (bs - 1)) == 0;
  const int bs_shift = __ffs(bs) - 1;
  // Block-table entry of this thread's key of tile t (-1: outside [k_begin, k_end), never read).
  auto load_block = [&](int t) -> int {
    const int key = k_begin + t * KT + my_kt;
    if (t >= ntiles || key >= k_end) return -1;
    return btab[bs_pow2 ? key >> bs_shift : key / bs];
  };
  auto issue = [&](int t, int blk) {
    if (t < ntiles) {
      T* stage = s_kv + (t % STAGES) * TILE_ELEMS;
      const int key = k_begin + t * KT + my_kt;
      const bool valid = blk >= 0;
      const int within = bs_pow2 ? key & (bs - 1) : key - (key / bs) * bs;
      const int64_t slot = valid ? (int64_t)blk * bs + within : 0;
      const T* ksrc = kcache + slot * k_slot_stride + (int64_t)kvh * DQK;
      T* kdst = stage + my_kt * DQK;
#pragma unroll
      for (int i = 0; i < CV_K; ++i) {
        const int v = sub + TPK * i;
        if (NV_K % TPK == 0 || v < NV_K) copy16_async(kdst + v * 8, ksrc + v * 8, valid);
      }
      const T* vsrc = vcache + slot * v_slot_stride + (int64_t)kvh * DV;
      T* vdst = stage + KT * DQK + my_kt * DV;
#pragma unroll
      for (int i = 0; i < CV_V; ++i) {
        const int v = sub + TPK * i;
        if (NV_V % TPK == 0 || v < NV_V) copy16_async(vdst + v * 8, vsrc + v * 8, valid);
      }
    }
    copy_commit();
  };

  // Start the pipeline before the query loads so that they overlap.
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) issue(s, load_block(s));
  int nblk = load_block(STAGES - 1);

  // Queries in registers, pre-scaled into the base-2 domain.
  const float qscale = p.scale * kLog2e;
  float qf[MT][VPL_K][8];
  const T* qbase = static_cast<const T*>(p.q);
#pragma unroll
  for (int mm = 0; mm < MT; ++mm) {
#pragma unroll
    for (int i = 0; i < VPL_K; ++i) {
      const int v = lane + LPT * i;
      if (mvalid[mm] && v < NV_K) {
        const T* src = qbase + (int64_t)(q0 + qi[mm]) * p.q_stride_token + (int64_t)head[mm] * p.q_stride_head + v * 8;
        const uint4 raw = *reinterpret_cast<const uint4*>(src);
        PeVec8<T>::to_float(raw, qf[mm][i]);
#pragma unroll
        for (int j = 0; j < 8; ++j) qf[mm][i][j] *= qscale;
      } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) qf[mm][i][j] = 0.f;
      }
    }
  }

  // A walk's running merge state (merge_range) of this thread's merge-stage (pair, 8 values) slots.
  constexpr int NIT = (MT * NV_V + kThreads - 1) / kThreads;
  float wm[NIT], wl[NIT], wo[NIT][8];
#pragma unroll
  for (int it = 0; it < NIT; ++it) {
    wm[it] = neg_inf();
    wl[it] = 0.f;
#pragma unroll
    for (int j = 0; j < 8; ++j) wo[it][j] = 0.f;
  }
  for (int r = 0; r < nranges; ++r) {
    if (r > 0) {  // the next range: restart the pipeline (the merge buffer is free again)
      k_begin = r * split_size;
      k_end = min(k_begin + split_size, k_lim);
      ntiles = (k_end - k_begin + KT - 1) / KT;
#pragma unroll
      for (int s = 0; s < STAGES - 1; ++s) issue(s, load_block(s));
      nblk = load_block(STAGES - 1);
    }
    float mx[MT], l[MT], acc[MT][VPL_V][8];
#pragma unroll
    for (int mm = 0; mm < MT; ++mm) {
      mx[mm] = neg_inf();
      l[mm] = 0.f;
#pragma unroll
      for (int i = 0; i < VPL_V; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[mm][i][j] = 0.f;
    }

    for (int t = 0; t < ntiles; ++t) {
      copy_wait<STAGES - 2>();  // tile t has landed (this thread's copies) ...
      __syncthreads();             // ... everyone's, and everyone is done with tile t - 1
      issue(t + STAGES - 1, nblk);
      nblk = load_block(t + STAGES);

      const T* sk = s_kv + (t % STAGES) * TILE_ELEMS;
      const T* sv = sk + KT * DQK;
      const int tile_base = k_begin + t * KT;
      // Scores.
      float s[U][MT];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int kt = group + NG * u;
        const int key = tile_base + kt;
        float sc[MT];
#pragma unroll
        for (int mm = 0; mm < MT; ++mm) sc[mm] = 0.f;
#pragma unroll
        for (int i = 0; i < VPL_K; ++i) {
          const int v = lane + LPT * i;
          if (NV_K % LPT == 0 || v < NV_K) {
            float kf[8];
            PeVec8<T>::to_float(*reinterpret_cast<const uint4*>(sk + kt * DQK + v * 8), kf);
#pragma unroll
            for (int mm = 0; mm < MT; ++mm)
#pragma unroll
              for (int j = 0; j < 8; ++j) sc[mm] = fmaf(qf[mm][i][j], kf[j], sc[mm]);
          }
        }
#pragma unroll
        for (int mm = 0; mm < MT; ++mm) {
#pragma unroll
          for (int off = LPT / 2; off > 0; off >>= 1) sc[mm] += pe_shfl_xor(sc[mm], off);
          s[u][mm] = key < lim[mm] && key < k_end ? sc[mm] : neg_inf();
        }
      }
      // Online softmax; the running sums are rescaled only when the running max moves.
      float pr[U][MT];
#pragma unroll
      for (int mm = 0; mm < MT; ++mm) {
        float mnew = mx[mm];
#pragma unroll
        for (int u = 0; u < U; ++u) mnew = fmaxf(mnew, s[u][mm]);
        if (mnew != mx[mm]) {  // uniform over the group: every lane holds the same reduced scores
          const float alpha = exp2f(mx[mm] - mnew);  // 0 when mx was -inf (acc and l are 0 then)
          l[mm] *= alpha;
#pragma unroll
          for (int i = 0; i < VPL_V; ++i)
#pragma unroll
            for (int j = 0; j < 8; ++j) acc[mm][i][j] *= alpha;
          mx[mm] = mnew;
        }
        const bool any = mnew != neg_inf();
        float psum = 0.f;
#pragma unroll
        for (int u = 0; u < U; ++u) {
          pr[u][mm] = any ? exp2f(s[u][mm] - mnew) : 0.f;
          psum += pr[u][mm];
        }
        l[mm] += psum;
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int kt = group + NG * u;
#pragma unroll
        for (int i = 0; i < VPL_V; ++i) {
          const int v = lane + LPT * i;
          if (NV_V % LPT == 0 || v < NV_V) {
            float vf[8];
            PeVec8<T>::to_float(*reinterpret_cast<const uint4*>(sv + kt * DV + v * 8), vf);
#pragma unroll
            for (int mm = 0; mm < MT; ++mm)
#pragma unroll
              for (int j = 0; j < 8; ++j) acc[mm][i][j] = fmaf(pr[u][mm], vf[j], acc[mm][i][j]);
          }
        }
      }
    }
    // The next kernel (a PDL-launched projection) may start streaming its weights: it still waits for
    // this one to finish before reading the output. Not at the start: with several waves of blocks,
    // its waiting blocks would hold SMs that this grid's later waves need.
    if (r == nranges - 1) pe_pdl_launch_dependents();
    copy_wait<0>();
    __syncthreads();  // the pipeline buffers become the merge buffer

    // Merge the key groups of the block.
#pragma unroll
    for (int mm = 0; mm < MT; ++mm) {
      if (lane == 0) {
        s_ml[group][mm][0] = mx[mm];
        s_ml[group][mm][1] = l[mm];
      }
#pragma unroll
      for (int i = 0; i < VPL_V; ++i) {
        const int v = lane + LPT * i;
        if (v < NV_V) {
#pragma unroll
          for (int j = 0; j < 8; ++j) s_acc[group][mm][v * 8 + j] = acc[mm][i][j];
        }
      }
    }
    __syncthreads();

    const bool direct = nsplit == 1;
#pragma unroll
    for (int it = 0; it < NIT; ++it) {
      const int idx = tid + it * kThreads;
      if (idx >= MT * NV_V) continue;
      const int mm = idx / NV_V;
      const int v = idx - mm * NV_V;
      const int m = m_begin + mm;
      if (m >= m_count) continue;
      const int i_tok = m / G;
      const int h = kvh * G + (m - i_tok * G);
      if (walk)
        walk_merge_pair<T, NG>(p, &s_ml[0][mm][0], MT * 2, &s_acc[0][mm][v * 8], MT * DV, q0 + i_tok, h, v,
                               r == nranges - 1, wm[it], wl[it], wo[it]);
      else
        merge_and_store_pair<T, NG>(p, &s_ml[0][mm][0], MT * 2, &s_acc[0][mm][v * 8], MT * DV, row, q0 + i_tok, i_tok, h,
                                    v, split, direct);
    }
    if (r + 1 < nranges) __syncthreads();  // the merge buffer becomes the pipeline again
  }
}

constexpr int kStages = 5;

template <typename T, int DQK, int DV, int LPT, int MT, int U>
void launch_main(const PagedAttentionParams& p, peStream_t s) {
  PagedAttentionParams f;
  const dim3 grid = gqa_grid(p, MT, &f);
  // (a launch error is the runtime's last error, which launch_paged_attention returns)
  (void)pe_launch(paged_attention_kernel<T, DQK, DV, LPT, MT, U, kStages>, grid, dim3(kThreads), 0, s, p.pdl, f);
}

// (LPT, U) fix the order of the arithmetic; they depend on the head dim and the group size only
// (the model), never on the batch. For head dims 64 and 128 they do not depend on MT either, so MT
// (query-head pairs per block) is free per launch (pairs_per_block). Each tile stages 8-9 KB of K/V
// per pipeline stage.
template <typename T, int D>
void launch_gqa(const PagedAttentionParams& p, peStream_t s, int mt) {
  if constexpr (D == 64) {
    switch (mt) {
      case 1: launch_main<T, D, D, 8, 1, 2>(p, s); break;
      case 2: launch_main<T, D, D, 8, 2, 2>(p, s); break;
      case 4: launch_main<T, D, D, 8, 4, 2>(p, s); break;
      default: launch_main<T, D, D, 8, 8, 2>(p, s); break;
    }
  } else if constexpr (D == 128) {
    switch (mt) {
      case 1: launch_main<T, D, D, 16, 1, 2>(p, s); break;
      case 2: launch_main<T, D, D, 16, 2, 2>(p, s); break;
      case 4: launch_main<T, D, D, 16, 4, 2>(p, s); break;
      default: launch_main<T, D, D, 16, 8, 2>(p, s); break;
    }
  } else {
    switch (mt) {
      case 1: launch_main<T, D, D, 16, 1, 1>(p, s); break;
      case 2: launch_main<T, D, D, 16, 2, 1>(p, s); break;
      case 4: launch_main<T, D, D, 16, 4, 1>(p, s); break;
      default: launch_main<T, D, D, 32, 8, 2>(p, s); break;
    }
  }
}

// Query-head pairs per block. The model's choice, the group size up to 8, lets every pair of a KV
// head share each K/V load. A grid that would not fill the GPU (batch-1 decode: one block per KV
// head) is latency-bound, so fewer pairs per block give more blocks and a shorter chain per key
// tile, for K/V re-read from L2; H100, 8B batch 1: step 5.744 ms with 1 pair vs 5.821-5.831 with 4.
// No bit changes (see launch_gqa), except for head dim 256, which keeps the model's choice.
// p.gqa_pairs_per_block (1, 2, 4 or 8) forces it (tests).
int pairs_per_block(const PagedAttentionParams& p) {
  const int G = p.num_q_heads / p.num_kv_heads;
  int mt = 1;
  while (mt < G && mt < 8) mt *= 2;
  if (p.head_dim_qk == 256) return mt;
  const int forced = p.gqa_pairs_per_block;
  if (forced != 0) return forced == 1 || forced == 2 || forced == 4 || forced == 8 ? forced : mt;
  auto blocks = [&](int m) {
    return (int64_t)p.num_rows * p.num_kv_heads * p.max_splits * ((p.max_query_len * G + m - 1) / m);
  };
  while (mt > 1 && blocks(mt) < p.num_sms) mt /= 2;
  return mt;
}

template <typename T>
int launch_typed(const PagedAttentionParams& p, peStream_t s) {
  if (p.head_dim_qk != p.head_dim_v) return -1;
#if !defined(PE_HIP)
  // NVIDIA runs the tensor-core kernel (paged_attention_mma.hip); the FMA kernel below is what hipcc
  // builds for AMD, and p.gqa_fma runs it on NVIDIA too (the tests compare both in one process).
  if (!p.gqa_fma) {
    const int rc = launch_paged_attention_mma(p, s);
    if (rc != 0) return rc;
    return launch_paged_attention_combine(p, s);
  }
#endif
  const int mt = pairs_per_block(p);
  switch (p.head_dim_qk) {
    case 64: launch_gqa<T, 64>(p, s, mt); break;
    case 128: launch_gqa<T, 128>(p, s, mt); break;
    case 256: launch_gqa<T, 256>(p, s, mt); break;
    default: return -1;
  }
  return launch_paged_attention_combine(p, s);
}

}  // namespace

int launch_paged_attention(const PagedAttentionParams& p, void* stream) {
  if (p.num_rows == 0 || p.max_query_len == 0) return 0;
  if (p.num_kv_heads <= 0 || p.num_q_heads % p.num_kv_heads != 0 || p.max_splits < 1 || p.split_block < 64 ||
      p.split_block % 64 != 0)
    return -1;
  const peStream_t s = static_cast<peStream_t>(stream);
  int rc;
  if (p.dtype == PE_FLOAT16) rc = launch_typed<pe_half>(p, s);
  else if (p.dtype == PE_BFLOAT16) rc = launch_typed<pe_bf16>(p, s);
  else rc = -1;
  if (rc != 0) return rc;
  return static_cast<int>(peGetLastError());
}
