// Device helpers shared by the paged-attention kernels (paged_attention.hip: GQA on CUDA cores and
// the split-KV combine; paged_attention_mma.hip: GQA on tensor cores; mla_attention.hip: MLA):
// infinities, the per-row split rule, 8-value stores, the GQA blocks' merge and write-out, and the
// asynchronous global -> shared copies. Include after hip_compat.h and paged_attention.h.
#pragma once

#include <type_traits>

#include "common/async_copy.h"
#include "common/hip_compat.h"
#include "attention/paged_attention.h"

namespace pe_attn {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

PE_DEVICE float neg_inf() { return -__int_as_float(0x7f800000); }
PE_DEVICE float pos_inf() { return __int_as_float(0x7f800000); }
// 1 / L of a state's sum of weights (0: no key), the factor its values are normalised by.
PE_DEVICE float inverse_sum(float L) { return L > 0.f ? 1.f / L : 0.f; }
// A finished state's log-sum-exp as the output holds it (natural log; +inf: no key).
PE_DEVICE float output_lse(float M, float L) { return L > 0.f ? (M + log2f(L)) * kLn2 : pos_inf(); }

// Per-row split rule (see paged_attention.h); the Python wrapper sizes the workspace from it. It
// reads only the row's own context and query length, so a row's result never depends on the batch.
PE_DEVICE void row_splits(int ctx, int q_len, int split_block, int* nsplit, int* split_size) {
  if (q_len > kPagedAttnSplitMaxQueryLen || ctx <= split_block) {
    *nsplit = 1;
    *split_size = ctx > 0 ? ctx : 1;
    return;
  }
  const int chunks = (ctx + split_block - 1) / split_block;
  const int size = split_block * ((chunks + kPagedAttnMaxSplits - 1) / kPagedAttnMaxSplits);
  *split_size = size;
  *nsplit = (ctx + size - 1) / size;
}

// The GQA kernels' split rule: row_splits, or under p.fixed_splits (batch-invariant mode) ranges of
// split_block keys at fixed boundaries 0, U, 2U, ...: a row of at most kSplitMaxQueryLen queries
// gives each range a split (workspace partial), a longer row or one of a single range has one split
// whose block walks the ranges itself (split_size = U either way).
PE_DEVICE void gqa_row_splits(const PagedAttentionParams& p, int ctx, int q_len, int* nsplit, int* split_size) {
  if (!p.fixed_splits) {
    row_splits(ctx, q_len, p.split_block, nsplit, split_size);
    return;
  }
  *split_size = p.split_block;
  *nsplit = q_len > kPagedAttnSplitMaxQueryLen || ctx <= p.split_block ? 1 : (ctx + p.split_block - 1) / p.split_block;
}

// The grid's y extent for flat tiles (the GQA kernels' blocks of mt query-head pairs), or 0 where
// the rectangular grid (rows x tiles of max_query_len) has no more blocks. Row r owns
// ceil(q_len_r * G / mt) tiles, so all rows own at most ceil(max_num_tokens * G / mt) + num_rows.
inline int flat_tile_slots(const PagedAttentionParams& p, int mt) {
  if (p.max_num_tokens <= 0) return 0;
  const int G = p.num_q_heads / p.num_kv_heads;
  const int64_t rect = (int64_t)p.num_rows * ((p.max_query_len * G + mt - 1) / mt);
  const int64_t flat = ((int64_t)p.max_num_tokens * G + mt - 1) / mt + p.num_rows;
  return flat < rect ? (int)flat : 0;
}

// A GQA launch's grid for blocks of mt query-head pairs, and in *launched the params its kernel
// takes (flat_tiles set): flat where flat_tile_slots says so, else (splits, tiles of max_query_len,
// rows x KV heads). Both GQA launchers take it.
inline dim3 gqa_grid(const PagedAttentionParams& p, int mt, PagedAttentionParams* launched) {
  *launched = p;
  const int flat = flat_tile_slots(p, mt);
  launched->flat_tiles = flat > 0;
  if (launched->flat_tiles) return dim3((unsigned)p.max_splits, (unsigned)flat, (unsigned)p.num_kv_heads);
  const int m_tiles = (p.max_query_len * (p.num_q_heads / p.num_kv_heads) + mt - 1) / mt;
  return dim3((unsigned)p.max_splits, (unsigned)m_tiles, (unsigned)(p.num_rows * p.num_kv_heads));
}

// The row, KV head and first query-head pair of this block's tile of mt pairs (false: the block
// has none). Rectangular grid: z = row * Hkv + head, y = the row's tile. Flat grid (p.flat_tiles):
// z = head, and y counts the rows' tiles in row order. Either way a tile is computed by one block
// the same way, so the schedule never changes a bit.
PE_DEVICE bool block_tile(const PagedAttentionParams& p, int mt, int* row, int* kvh, int* m_begin) {
  if (!p.flat_tiles) {
    *row = blockIdx.z / p.num_kv_heads;
    *kvh = blockIdx.z - *row * p.num_kv_heads;
    *m_begin = blockIdx.y * mt;
    return true;
  }
  // Row ends loaded at once: a block whose tile lies past the rows (padding rows of a graph hold none)
  // walks all of them, and each round waits on a load; 128 rows (batch 64 in a graph) take 4 rounds.
  constexpr int kAhead = 32;
  const int G = p.num_q_heads / p.num_kv_heads;
  *kvh = blockIdx.z;
  int y = blockIdx.y;
  int start = p.query_start_loc[0];
  for (int r0 = 0; r0 < p.num_rows; r0 += kAhead) {
    int end[kAhead];
#pragma unroll
    for (int u = 0; u < kAhead; ++u) end[u] = r0 + u < p.num_rows ? p.query_start_loc[r0 + u + 1] : 0;
#pragma unroll
    for (int u = 0; u < kAhead; ++u) {
      if (r0 + u >= p.num_rows) return false;
      const int tiles = ((end[u] - start) * G + mt - 1) / mt;
      if (y < tiles) {
        *row = r0 + u;
        *m_begin = y * mt;
        return true;
      }
      y -= tiles;
      start = end[u];
    }
  }
  return false;
}

// Two floats -> one 32-bit pair of T (lower index in the lower half), one rounding each: the
// 16-bit operand pairs of the tensor-core products (P of P V).
template <typename T>
PE_DEVICE uint32_t pack2(float lo, float hi) {
#if defined(PE_CUDA) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  // One hardware conversion (the same round-to-nearest-even) instead of two software roundings:
  // P of P V is converted on the attention kernels' critical path.
  uint32_t d;
  if constexpr (std::is_same<T, pe_bf16>::value)
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  else
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
#else
  return PeVec8<T>::from_float(lo) | ((uint32_t)PeVec8<T>::from_float(hi) << 16);
#endif
}

// Eight floats -> one 16-byte vector of T (pe_half / pe_bf16), one rounding each.
template <typename T>
PE_DEVICE void store8(T* dst, const float* f) {
  uint16_t b[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) b[j] = PeVec8<T>::from_float(f[j]);
  uint4 v;
  v.x = b[0] | ((uint32_t)b[1] << 16);
  v.y = b[2] | ((uint32_t)b[3] << 16);
  v.z = b[4] | ((uint32_t)b[5] << 16);
  v.w = b[6] | ((uint32_t)b[7] << 16);
  *reinterpret_cast<uint4*>(dst) = v;
}

// Merges the NPARTS partial results of a GQA block's key groups for one (token, head) pair and its
// output values v * 8 .. + 7, in order (part w: running max (base 2) at ml[w * ml_stride], sum at
// ml[w * ml_stride + 1], 8 values at acc + w * acc_stride): M, L and the normalised values o.
template <int NPARTS>
PE_DEVICE void merge_parts(const float* ml, int ml_stride, const float* acc, int acc_stride, float* M_out, float* L_out,
                           float* o) {
  float M = neg_inf();
#pragma unroll
  for (int w = 0; w < NPARTS; ++w) M = fmaxf(M, ml[w * ml_stride]);
  float L = 0.f;
#pragma unroll
  for (int j = 0; j < 8; ++j) o[j] = 0.f;
  if (M != neg_inf()) {
#pragma unroll
    for (int w = 0; w < NPARTS; ++w) {
      const float wt = exp2f(ml[w * ml_stride] - M);
      L += ml[w * ml_stride + 1] * wt;
#pragma unroll
      for (int j = 0; j < 8; ++j) o[j] += acc[w * acc_stride + j] * wt;
    }
  }
  const float inv = inverse_sum(L);
#pragma unroll
  for (int j = 0; j < 8; ++j) o[j] *= inv;
  *M_out = M;
  *L_out = L;
}

// A split's (or key range's) partial log-sum-exp (base 2) as the workspace holds it; -inf: no key.
PE_DEVICE float partial_lse(float M, float L) { return L > 0.f ? M + log2f(L) : neg_inf(); }

// The batch-invariant merge of key-range partials, applied in range order from the empty state
// (m = -inf, l = 0, o = 0) by the combine kernel (workspace partials) and by a block that walks its
// ranges (prefill rows): one sequence of fp32 operations, so a query's bits do not depend on where
// its ranges were computed. A range without keys for the query (lse -inf) is an exact no-op.
// The merged reference m moves only when a range's lse passes it by more than kMergeSlack (base-2
// units; always from the empty state), as the softmax's reference does (mla_softmax.h): otherwise
// o += b po (b = 2^(lse - m) <= 2^8) is one add, rounded once with subnormal inputs and result
// flushed to zero (merge_add) - the arithmetic of the L2's red.add.f32, so that a walking MLA block
// adds a range into its merged state in memory without reading it back (mla_slab.h).
constexpr float kMergeSlack = 8.f;

// x + y rounded to nearest even, subnormal inputs and result flushed to signed zero.
PE_DEVICE float merge_add(float x, float y) {
#if defined(PE_CUDA) && defined(__CUDA_ARCH__)
  float r;
  asm("add.rn.ftz.f32 %0, %1, %2;" : "=f"(r) : "f"(x), "f"(y));
  return r;
#else
  auto flush = [](float v) { return fabsf(v) < 1.17549435e-38f ? copysignf(0.f, v) : v; };
  return flush(flush(x) + flush(y));
#endif
}

PE_DEVICE void merge_range(float& m, float& l, float* o, float lse, const float* po) {
  if (lse == neg_inf()) return;
  if (lse > m + kMergeSlack) {  // the reference moves to lse (b = 1)
    const float a = exp2f(m - lse);  // 0 from the empty state
    l = fmaf(l, a, 1.f);
#pragma unroll
    for (int j = 0; j < 8; ++j) o[j] = fmaf(o[j], a, po[j]);
    m = lse;
  } else {
    const float b = exp2f(lse - m);
    l += b;
#pragma unroll
    for (int j = 0; j < 8; ++j) o[j] = merge_add(o[j], b * po[j]);
  }
}

// out (8 values of pair (t, h)) and lse (natural log; +inf without keys) of a merged state.
template <typename T>
PE_DEVICE void store_merged(const PagedAttentionParams& p, int t, int h, int v, float m, float l, float* o) {
  const float inv = inverse_sum(l);
#pragma unroll
  for (int j = 0; j < 8; ++j) o[j] *= inv;
  T* dst = static_cast<T*>(p.out) + (int64_t)t * p.out_stride_token + (int64_t)h * p.out_stride_head + v * 8;
  store8<T>(dst, o);
  if (v == 0 && p.lse != nullptr) p.lse[(int64_t)t * p.num_q_heads + h] = output_lse(m, l);
}

// The end of a GQA block for one (token t = query_start_loc[row] + i_tok, head h) pair and its
// output values v * 8 .. + 7: merges the key groups (merge_parts), and writes out + lse (direct: a
// row of one split) or the split's partial to the workspace. Shared by the FMA and tensor-core GQA
// kernels.
template <typename T, int NPARTS>
PE_DEVICE void merge_and_store_pair(const PagedAttentionParams& p, const float* ml, int ml_stride, const float* acc,
                                    int acc_stride, int row, int t, int i_tok, int h, int v, int split, bool direct) {
  float M, L, o[8];
  merge_parts<NPARTS>(ml, ml_stride, acc, acc_stride, &M, &L, o);
  const int Hq = p.num_q_heads;
  if (direct) {
    T* dst = static_cast<T*>(p.out) + (int64_t)t * p.out_stride_token + (int64_t)h * p.out_stride_head + v * 8;
    store8<T>(dst, o);
    if (v == 0 && p.lse != nullptr) p.lse[(int64_t)t * Hq + h] = output_lse(M, L);
  } else {
    const int64_t w = ((int64_t)(p.ws_start[row] + i_tok) * Hq + h) * p.max_splits + split;
    float4* dst = reinterpret_cast<float4*>(p.ws_out + w * p.head_dim_v + v * 8);
    dst[0] = make_float4(o[0], o[1], o[2], o[3]);
    dst[1] = make_float4(o[4], o[5], o[6], o[7]);
    if (v == 0) p.ws_lse[w] = partial_lse(M, L);
  }
}

// A walking block's end of key range r of nranges for one pair's values v * 8 .. + 7: merges the
// range's partial (merge_parts, partial_lse: the values a split would write to the workspace) into
// the running state (m, l, o), which the caller keeps between ranges, and stores the result after
// the last range.
template <typename T, int NPARTS>
PE_DEVICE void walk_merge_pair(const PagedAttentionParams& p, const float* ml, int ml_stride, const float* acc,
                               int acc_stride, int t, int h, int v, bool last, float& m, float& l, float* o) {
  float M, L, po[8];
  merge_parts<NPARTS>(ml, ml_stride, acc, acc_stride, &M, &L, po);
  merge_range(m, l, o, partial_lse(M, L), po);
  if (last) store_merged<T>(p, t, h, v, m, l, o);
}

// Asynchronous global -> shared copies: common/async_copy.h.
using pe_copy::copy16_async;
using pe_copy::copy_commit;
using pe_copy::copy_wait;

}  // namespace pe_attn
