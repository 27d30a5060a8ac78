// The split-KV combine that the GQA kernels (paged_attention.hip, paged_attention_mma.hip) and the
// MLA kernels share: merges the partial results that split rows left in the workspace, one thread
// per (query token, head, 8 values). Semantics and the split rules: paged_attention.h.
#include "common/hip_compat.h"
#include "attention/paged_attention.h"
#include "attention/attention_common.h"

#include <math.h>

namespace {

using pe_attn::gqa_row_splits;
using pe_attn::merge_range;
using pe_attn::neg_inf;
using pe_attn::store_merged;

constexpr int kThreads = 128;

// Merges the splits of split rows: grid (rows, kPagedAttnSplitMaxQueryLen, chunks of Hq * DV / 8).
template <typename T>
__global__ void __launch_bounds__(kThreads) paged_attention_combine_kernel(PagedAttentionParams p) {
  const int row = blockIdx.x;
  const int i_tok = blockIdx.y;
  const int q0 = p.query_start_loc[row];
  const int q_len = p.query_start_loc[row + 1] - q0;
  if (i_tok >= q_len) return;
  int nsplit, split_size;
  gqa_row_splits(p, p.context_lens[row], q_len, &nsplit, &split_size);
  if (nsplit == 1) return;
  const int NV = p.head_dim_v / 8;
  const int idx = blockIdx.z * kThreads + threadIdx.x;
  if (idx >= p.num_q_heads * NV) return;
  const int h = idx / NV;
  const int v = idx - h * NV;
  const int64_t w0 = ((int64_t)(p.ws_start[row] + i_tok) * p.num_q_heads + h) * p.max_splits;
  if (p.fixed_splits) {  // the batch-invariant merge, in range order (what a walking block does)
    // Up to 64+ ranges per query at long contexts and few threads at batch 1: the loads of kAhead
    // ranges are issued before their merges (padding ranges read as empty: exact no-ops).
    constexpr int kAhead = 8;
    float m = neg_inf(), l = 0.f, o[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int s0 = 0; s0 < nsplit; s0 += kAhead) {
      float lse[kAhead];
      float4 a[kAhead], b[kAhead];
#pragma unroll
      for (int u = 0; u < kAhead; ++u) {
        const bool in = s0 + u < nsplit;
        const float4* src = reinterpret_cast<const float4*>(p.ws_out + (w0 + s0 + u) * p.head_dim_v + v * 8);
        lse[u] = in ? p.ws_lse[w0 + s0 + u] : neg_inf();
        a[u] = in ? src[0] : make_float4(0.f, 0.f, 0.f, 0.f);
        b[u] = in ? src[1] : make_float4(0.f, 0.f, 0.f, 0.f);
      }
#pragma unroll
      for (int u = 0; u < kAhead; ++u) {
        const float po[8] = {a[u].x, a[u].y, a[u].z, a[u].w, b[u].x, b[u].y, b[u].z, b[u].w};
        merge_range(m, l, o, lse[u], po);
      }
    }
    store_merged<T>(p, q0 + i_tok, h, v, m, l, o);
    return;
  }
  float M = neg_inf();
  for (int s = 0; s < nsplit; ++s) M = fmaxf(M, p.ws_lse[w0 + s]);
  float L = 0.f, o[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  if (M != neg_inf()) {
    for (int s = 0; s < nsplit; ++s) {
      const float w = exp2f(p.ws_lse[w0 + s] - M);
      L += w;
      const float4* src = reinterpret_cast<const float4*>(p.ws_out + (w0 + s) * p.head_dim_v + v * 8);
      const float4 a = src[0], b = src[1];
      o[0] += w * a.x; o[1] += w * a.y; o[2] += w * a.z; o[3] += w * a.w;
      o[4] += w * b.x; o[5] += w * b.y; o[6] += w * b.z; o[7] += w * b.w;
    }
  }
  store_merged<T>(p, q0 + i_tok, h, v, M, L, o);
}

template <typename T>
void launch_combine(const PagedAttentionParams& p, peStream_t s) {
  const int qmax = p.max_query_len < kPagedAttnSplitMaxQueryLen ? p.max_query_len : kPagedAttnSplitMaxQueryLen;
  const int chunks = (p.num_q_heads * (p.head_dim_v / 8) + kThreads - 1) / kThreads;
  const dim3 grid((unsigned)p.num_rows, (unsigned)qmax, (unsigned)chunks);
  paged_attention_combine_kernel<T><<<grid, kThreads, 0, s>>>(p);
}

}  // namespace

int launch_paged_attention_combine(const PagedAttentionParams& p, void* stream) {
  if (p.num_rows == 0 || p.max_query_len == 0 || p.max_splits <= 1) return 0;
  const peStream_t s = static_cast<peStream_t>(stream);
  if (p.dtype == PE_FLOAT16) launch_combine<pe_half>(p, s);
  else if (p.dtype == PE_BFLOAT16) launch_combine<pe_bf16>(p, s);
  else return -1;
  return static_cast<int>(peGetLastError());
}
