// The fast tile's range fold (NVIDIA sm_90a only; mla_decode_fast.hip): a walking block's merged
// state in its slab of the accumulator pool, laid out per thread, and kept in L2.
//
// The fold is merge_range (attention_common.h) on the same fp32 values in the same order as the
// small tile's fold_range_row and the combine kernel, so the bits do not change; only the slab's
// layout and traffic do (and where the merged reference stays, the L2 does the add: slab_add4):
// - per-thread layout: vector v (4 values) of thread tid at floats (v * 256 + tid) * 4, so that a
//   warp's access is 512 contiguous bytes of 16-byte vectors (the slab is private to the block);
// - a row's 16 vectors are loaded in batches of kFoldBatch before any is used;
// - createpolicy evict_last on every slab access, so that the slab (128 KB per block, ~17 MB for
//   the pool) stays in L2 while the keys stream past it, and discard.global.L2 once the last range is
//   read, so that its dirty lines are dropped rather than written back to HBM. evict_last keeps lines
//   only inside the device's persisting L2 set-aside, which launch_mla_grid (mla_attention.hip) sets
//   to the pool's size: with none (the default) the hints were inert.
// A range end that must rescale the state (its reference moved) moves 128 KB in and out per block;
// one that adds (the usual case) only sends 128 KB of red.add to the L2 (docs/kernels/attention.md).
#pragma once

#if !defined(PE_HIP)
#include "attention/attention_common.h"
#include "attention/mla_ranges.h"

namespace pe_mla {

constexpr int kFoldBatch = 8;  // vectors in flight per thread (32 registers, free while S is dead)

PE_DEVICE uint64_t slab_policy() {
  uint64_t pol;
  asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;\n" : "=l"(pol));
  return pol;
}

PE_DEVICE float4 slab_load4(const float* a, uint64_t pol) {
  float4 v;
  asm volatile("ld.global.L2::cache_hint.v4.f32 {%0, %1, %2, %3}, [%4], %5;\n"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "l"(a), "l"(pol));
  return v;
}

PE_DEVICE void slab_store4(float* a, const float4& v, uint64_t pol) {
  asm volatile("st.global.L2::cache_hint.v4.f32 [%0], {%1, %2, %3, %4}, %5;\n" ::"l"(a), "f"(v.x), "f"(v.y), "f"(v.z),
               "f"(v.w), "l"(pol)
               : "memory");
}

// Drops this thread's share of a 64 x 512 slab (1024 lines of 128 bytes, 4 per thread of 256) from
// L2 without writing it back. Called after a barrier that follows the block's last slab read; the
// release's fence orders it before the next owner's stores.
PE_DEVICE void discard_slab(float* slab, int tid) {
#pragma unroll
  for (int k = 0; k < 4; ++k) asm volatile("discard.global.L2 [%0], 128;\n" ::"l"(slab + (tid * 4 + k) * 32) : "memory");
}

// red.add of 4 values into the slab (the L2 adds: rounded once, subnormals flushed, as merge_add).
PE_DEVICE void slab_add4(float* a, const float4& v, uint64_t pol) {
  asm volatile("red.global.add.L2::cache_hint.v4.f32 [%0], {%1, %2, %3, %4}, %5;\n" ::"l"(a), "f"(v.x), "f"(v.y),
               "f"(v.z), "f"(v.w), "l"(pol)
               : "memory");
}

// Row J (0 or 1) of this thread at the end of a range (semantics: fold_range_row): o holds the
// thread's 128 accumulator values, row J's at o[4 nt + 2 J + e] (columns 8 nt + e of `out`);
// vector u of row J is {o[8u + 2J], o[8u + 2J + 1], o[8u + 4 + 2J], o[8u + 4 + 2J + 1]} at
// mine + (J * 16 + u) * 1024 (mine = slab + 4 tid; unused when the state is empty and this is the
// last range). lse: the range's base-2 log-sum-exp, inv its 1 / L. Where the merged reference stays
// (merge_range: no rescale of the state), a range that is not the last is added into the slab by the
// L2 (slab_add4) without being read: a fold then costs the SM its stores alone.
template <typename T, int J>
PE_DEVICE void fold_fast_row(MergedRow& st, float lse, float inv, const float (&o)[128], float* mine, T* out,
                             float* out_lse, bool write_lse, bool last, uint64_t pol) {
  if (lse == neg_inf() && !last) return;  // no key of the range for this pair: merge_range's no-op
  const bool empty = st.m == neg_inf();
  const bool merge = lse != neg_inf();
  // merge_range's rule (attention_common.h), restated for this layout: one shared scalar helper
  // made this kernel's fold compile 3-8% slower on the H100 (docs/kernels/attention.md).
  const bool moves = merge && lse > st.m + pe_attn::kMergeSlack;  // merge_range's branches, once per row
  float m = st.m, l = st.l, a = 1.f, b = 0.f;
  if (moves) {
    a = exp2f(m - lse);  // 0 from the empty state
    l = fmaf(l, a, 1.f);
    m = lse;
  } else if (merge) {
    b = exp2f(lse - m);
    l += b;
  }
  auto range_values = [&](int u, float (&y)[4]) {  // the range's normalised partial, vector u
    const int i = 8 * u + 2 * J;
    y[0] = o[i] * inv, y[1] = o[i + 1] * inv, y[2] = o[i + 4] * inv, y[3] = o[i + 5] * inv;
  };
  if (merge && !moves && !last) {
#pragma unroll
    for (int u = 0; u < 16; ++u) {
      float y[4];
      range_values(u, y);
      slab_add4(mine + (J * 16 + u) * 1024, make_float4(b * y[0], b * y[1], b * y[2], b * y[3]), pol);
    }
  } else {
    const float inv_l = pe_attn::inverse_sum(l);
#pragma unroll
    for (int u0 = 0; u0 < 16; u0 += kFoldBatch) {
      float4 v[kFoldBatch];
#pragma unroll
      for (int u = 0; u < kFoldBatch; ++u)
        v[u] = empty ? make_float4(0.f, 0.f, 0.f, 0.f) : slab_load4(mine + (J * 16 + u0 + u) * 1024, pol);
#pragma unroll
      for (int u = 0; u < kFoldBatch; ++u) {
        float x[4] = {v[u].x, v[u].y, v[u].z, v[u].w}, y[4];
        range_values(u0 + u, y);
#pragma unroll
        for (int k = 0; k < 4; ++k) x[k] = moves ? fmaf(x[k], a, y[k]) : merge ? pe_attn::merge_add(x[k], b * y[k]) : x[k];
        if (last) {
          T* dst = out + 16 * (u0 + u);
          *reinterpret_cast<uint32_t*>(dst) = pe_attn::pack2<T>(x[0] * inv_l, x[1] * inv_l);
          *reinterpret_cast<uint32_t*>(dst + 8) = pe_attn::pack2<T>(x[2] * inv_l, x[3] * inv_l);
        } else {
          slab_store4(mine + (J * 16 + u0 + u) * 1024, make_float4(x[0], x[1], x[2], x[3]), pol);
        }
      }
    }
  }
  st.m = m;
  st.l = l;
  if (last && write_lse && out_lse != nullptr) *out_lse = pe_attn::output_lse(m, l);
}

}  // namespace pe_mla
#endif  // !PE_HIP
