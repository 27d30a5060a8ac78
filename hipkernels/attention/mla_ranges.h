// Fixed key ranges of the MLA kernels (semantics: mla_attention.h), shared by both tiles. A query's
// keys [0, lim) are summed in ranges [r U, (r + 1) U), U = split_block, each from a fresh online-
// softmax state in key tiles aligned at key 0; a range's normalised partial (values o / L, base-2
// log-sum-exp M + log2 L) is merged in range order from the empty state by merge_range
// (attention_common.h), the function of the split-KV combine. Who computes a range follows the step
// (MlaWork): one block per range with the partial in the workspace and the combine's merge (split
// rows), or one block walking the row's ranges and merging each partial as its range ends (walking
// rows). Both run the same tiles and the same fp32 operations, so a query's bits never depend on the
// assignment, hence never on the batch.
#pragma once

#include "common/hip_compat.h"
#include "attention/paged_attention.h"
#include "attention/attention_common.h"

namespace pe_mla {

using pe_attn::merge_range;
using pe_attn::neg_inf;

// What one block computes: pairs m_begin .. of `row`, key tiles [t_begin, t_end) of kN keys (tile t
// holds keys kN t .. kN t + kN - 1; keys >= k_end are zero-filled: no pair of the block sees them).
struct MlaWork {
  int row, q0, q_len, ctx, m_begin, m_count;
  int t_begin, t_end, k_end;
  int tiles_per_range;  // U / kN
  int split;            // >= 0: the one range this block computes, its partial to workspace split `split`
};

// The ranges of a row follow the step's rule (gqa_row_splits): under p.fixed_splits ranges of U =
// split_block keys, one block each for the rows the combine takes (q_len <= kSplitMaxQueryLen,
// ctx > U) unless the step walks (p.mla_walk), every other row walked by blockIdx.y == 0 with the
// in-order merge; under the default rule (row_splits: at most kMaxSplits splits of a size that grows
// with the row's context) a split row's block computes its split as one range, and any other row is
// one range. False: this block has no work.
template <int kM, int kN>
PE_DEVICE bool mla_work(const PagedAttentionParams& p, MlaWork* w) {
  const int Hq = p.num_q_heads;
  w->row = blockIdx.z;
  w->q0 = p.query_start_loc[w->row];
  w->q_len = p.query_start_loc[w->row + 1] - w->q0;
  w->ctx = p.context_lens[w->row];
  w->m_begin = blockIdx.x * kM;
  w->m_count = w->q_len * Hq;
  if (w->m_begin >= w->m_count) return false;
  int nsplit, U;
  pe_attn::gqa_row_splits(p, w->ctx, w->q_len, &nsplit, &U);
  int r_begin, r_end;
  if (nsplit > 1 && !p.mla_walk) {
    if ((int)blockIdx.y >= nsplit) return false;
    r_begin = blockIdx.y;
    r_end = r_begin + 1;
    w->split = r_begin;
  } else {
    if (blockIdx.y != 0) return false;
    if (!p.fixed_splits) U = (max(w->ctx, 1) + kN - 1) / kN * kN;  // the whole row, one range
    r_begin = 0;
    r_end = (max(w->ctx, 1) + U - 1) / U;
    w->split = -1;
  }
  const int m_last = min(w->m_begin + kM, w->m_count) - 1;
  const int k_begin = r_begin * U;
  w->k_end = min(min(w->ctx, r_end * U), w->ctx - (w->q_len - 1 - m_last / Hq));
  w->tiles_per_range = U / kN;
  w->t_begin = k_begin / kN;
  w->t_end = w->k_end > k_begin ? (w->k_end + kN - 1) / kN : w->t_begin;
  return true;
}

// The accumulator pool: a walking block of more than one range takes a free slab of kM x kDv fp32
// values. At most (blocks per SM) x (SMs) blocks are resident, and the launcher checks that the pool
// has that many slabs, so a free one always exists (a block spins only while another one leaves).
// Called by thread 0; the caller's barrier publishes the slot.
PE_DEVICE int acquire_slab(const PagedAttentionParams& p, int nslots) {
  int s = (int)((blockIdx.z * gridDim.x + blockIdx.x) % (unsigned)nslots);
  while (atomicCAS(p.mla_locks + s, 0, 1) != 0) s = s + 1 == nslots ? 0 : s + 1;
  __threadfence();
  return s;
}

// Called by thread 0 after a barrier that follows the block's last slab access.
PE_DEVICE void release_slab(const PagedAttentionParams& p, int s) {
  __threadfence();
  atomicExch(p.mla_locks + s, 0);
}

// Slab accesses of the small tile: plain loads and stores (the fast tile has its own layout and L2
// hints, mla_slab.h). The key copies take no cache policy: the cp.async form with both a source size
// and a cache policy raised "illegal instruction" on the H100 (docs/kernels/attention.md).
PE_DEVICE float2 load_slab(const float* a) { return *reinterpret_cast<const float2*>(a); }

PE_DEVICE void store_slab(float* a, float x, float y) { *reinterpret_cast<float2*>(a) = make_float2(x, y); }

// The merged state of one query-head pair in a walking block: m (base 2), l, and (once a range is
// merged) the values in the block's slab.
struct MergedRow {
  float m = neg_inf(), l = 0.f;
};

// One pair row of a walking block at the end of a range: merges the range's partial (values
// o[4 nt + e] * inv at columns 8 nt + e of `slab` and `out`, nt < kNT, e < 2: the tensor-core
// accumulator layout; base-2 lse) into the merged state with merge_range, 8 values per call as the
// combine kernel does (the first merge starts from the empty state without reading the slab), and
// writes the state back to the slab, or, after the last range, the output with store_merged's
// operations (values * 1/l rounded to T; lse (m + log2 l) ln 2, +inf without keys, by the lane
// with write_lse). out_lse may be null.
template <typename T, int kNT>
PE_DEVICE void fold_range_row(MergedRow& st, float lse, float inv, const float* o, float* slab, T* out,
                              float* out_lse, bool write_lse, bool last) {
  static_assert(kNT % 4 == 0, "8 values per merge");
  if (lse == neg_inf() && !last) return;  // the range has no key for this pair: merge_range's no-op
  const bool empty = st.m == neg_inf();
  float m = st.m, l = st.l;
#pragma unroll
  for (int c = 0; c < kNT / 4; ++c) {
    float acc[8], po[8];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int nt = 4 * c + u;
      const float2 v = empty ? make_float2(0.f, 0.f) : load_slab(slab + 8 * nt);
      acc[2 * u] = v.x;
      acc[2 * u + 1] = v.y;
      po[2 * u] = o[4 * nt] * inv;
      po[2 * u + 1] = o[4 * nt + 1] * inv;
    }
    m = st.m;
    l = st.l;
    merge_range(m, l, acc, lse, po);
    if (last) {
      const float inv_l = pe_attn::inverse_sum(l);
#pragma unroll
      for (int u = 0; u < 4; ++u)
        *reinterpret_cast<uint32_t*>(out + 8 * (4 * c + u)) = pe_attn::pack2<T>(acc[2 * u] * inv_l, acc[2 * u + 1] * inv_l);
    } else {
#pragma unroll
      for (int u = 0; u < 4; ++u) store_slab(slab + 8 * (4 * c + u), acc[2 * u], acc[2 * u + 1]);
    }
  }
  st.m = m;
  st.l = l;
  if (last && write_lse && out_lse != nullptr) *out_lse = pe_attn::output_lse(m, l);
}

}  // namespace pe_mla
