// Paged attention (decode, verify, prefill chunks and mixed batches in one launch) plus the
// split-KV combine. Semantics and the split rule: paged_attention.h.
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
#include "hip_compat.h"
#include "paged_attention.h"

#include <math.h>

namespace {

constexpr int kThreads = 128;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

PE_DEVICE float neg_inf() { return -__int_as_float(0x7f800000); }
PE_DEVICE float pos_inf() { return __int_as_float(0x7f800000); }

// Per-row split rule (see paged_attention.h); the Python wrapper sizes the workspace from it.
PE_DEVICE void row_splits(int ctx, int q_len, int* nsplit, int* split_size) {
  if (q_len > kPagedAttnSplitMaxQueryLen || ctx <= kPagedAttnSplitBlock) {
    *nsplit = 1;
    *split_size = ctx > 0 ? ctx : 1;
    return;
  }
  const int chunks = (ctx + kPagedAttnSplitBlock - 1) / kPagedAttnSplitBlock;
  const int size = kPagedAttnSplitBlock * ((chunks + kPagedAttnMaxSplits - 1) / kPagedAttnMaxSplits);
  *split_size = size;
  *nsplit = (ctx + size - 1) / size;
}

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

// T: pe_half or pe_bf16. DQK/DV: head dims. LPT: lanes per key. MT: query-head pairs per block.
// U: keys per group per iteration. SHARED_KV: V is the first DV values of K (MLA).
template <typename T, int DQK, int DV, int LPT, int MT, int U, bool SHARED_KV>
__global__ void __launch_bounds__(kThreads) paged_attention_kernel(PagedAttentionParams p) {
  constexpr int NV_K = DQK / 8;                    // 16-byte vectors per K row
  constexpr int NV_V = DV / 8;
  constexpr int VPL_K = (NV_K + LPT - 1) / LPT;    // vectors per lane
  constexpr int VPL_V = (NV_V + LPT - 1) / LPT;
  constexpr int NG = kThreads / LPT;               // key groups per block
  static_assert(DQK % 8 == 0 && DV % 8 == 0 && LPT <= 32 && (LPT & (LPT - 1)) == 0, "layout");
  static_assert(!SHARED_KV || NV_V <= NV_K, "V must be a prefix of K");

  __shared__ float s_ml[NG][MT][2];
  __shared__ __align__(16) float s_acc[NG][MT][DV];

  const int Hkv = p.num_kv_heads;
  const int Hq = p.num_q_heads;
  const int G = Hq / Hkv;
  const int row = blockIdx.z / Hkv;
  const int kvh = blockIdx.z - row * Hkv;
  const int q0 = p.query_start_loc[row];
  const int q_len = p.query_start_loc[row + 1] - q0;
  const int ctx = p.context_lens[row];
  const int m_begin = blockIdx.y * MT;
  const int m_count = q_len * G;
  if (m_begin >= m_count) return;
  int nsplit, split_size;
  row_splits(ctx, q_len, &nsplit, &split_size);
  const int split = blockIdx.x;
  if (split >= nsplit) return;

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
  const int k_begin = split * split_size;
  const int k_end = min(min(ctx, k_begin + split_size), ctx - (q_len - 1 - m_last / G));

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

  const T* kcache = static_cast<const T*>(p.k_cache);
  const T* vcache = static_cast<const T*>(SHARED_KV ? p.k_cache : p.v_cache);
  const int32_t* btab = p.block_tables + (int64_t)row * p.max_blocks_per_row;
  const int bs = p.block_size;
  const int64_t k_slot_stride = (int64_t)Hkv * DQK;
  const int64_t v_slot_stride = (int64_t)Hkv * DV;

  for (int base = k_begin; base < k_end; base += NG * U) {
    uint4 kr[U][VPL_K];
    uint4 vr[U][SHARED_KV ? 1 : VPL_V];
    int key[U];
    // Issue every load of this iteration first.
#pragma unroll
    for (int u = 0; u < U; ++u) {
      key[u] = base + group + NG * u;
      const bool valid = key[u] < k_end;
      int64_t slot = 0;
      if (valid) {
        const int blk = btab[key[u] / bs];
        slot = (int64_t)blk * bs + (key[u] - (key[u] / bs) * bs);
      }
      const T* kp = kcache + slot * k_slot_stride + (int64_t)kvh * DQK;
#pragma unroll
      for (int i = 0; i < VPL_K; ++i) {
        const int v = lane + LPT * i;
        if (valid && v < NV_K) kr[u][i] = *reinterpret_cast<const uint4*>(kp + v * 8);
        else kr[u][i] = make_uint4(0u, 0u, 0u, 0u);
      }
      if (!SHARED_KV) {
        const T* vp = vcache + slot * v_slot_stride + (int64_t)kvh * DV;
#pragma unroll
        for (int i = 0; i < (SHARED_KV ? 1 : VPL_V); ++i) {
          const int v = lane + LPT * i;
          if (valid && v < NV_V) vr[u][i] = *reinterpret_cast<const uint4*>(vp + v * 8);
          else vr[u][i] = make_uint4(0u, 0u, 0u, 0u);
        }
      }
    }
    // Scores.
    float s[U][MT];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float sc[MT];
#pragma unroll
      for (int mm = 0; mm < MT; ++mm) sc[mm] = 0.f;
#pragma unroll
      for (int i = 0; i < VPL_K; ++i) {
        float kf[8];
        PeVec8<T>::to_float(kr[u][i], kf);
#pragma unroll
        for (int mm = 0; mm < MT; ++mm)
#pragma unroll
          for (int j = 0; j < 8; ++j) sc[mm] = fmaf(qf[mm][i][j], kf[j], sc[mm]);
      }
#pragma unroll
      for (int mm = 0; mm < MT; ++mm) {
#pragma unroll
        for (int off = LPT / 2; off > 0; off >>= 1) sc[mm] += pe_shfl_xor(sc[mm], off);
        s[u][mm] = key[u] < lim[mm] && key[u] < k_end ? sc[mm] : neg_inf();
      }
    }
    // Online softmax: probabilities and rescale of the running sums.
    float pr[U][MT];
#pragma unroll
    for (int mm = 0; mm < MT; ++mm) {
      float mnew = mx[mm];
#pragma unroll
      for (int u = 0; u < U; ++u) mnew = fmaxf(mnew, s[u][mm]);
      const bool any = mnew != neg_inf();
      const float alpha = any ? exp2f(mx[mm] - mnew) : 1.f;
      float psum = 0.f;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        pr[u][mm] = any ? exp2f(s[u][mm] - mnew) : 0.f;
        psum += pr[u][mm];
      }
      l[mm] = l[mm] * alpha + psum;
      mx[mm] = mnew;
#pragma unroll
      for (int i = 0; i < VPL_V; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[mm][i][j] *= alpha;
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
#pragma unroll
      for (int i = 0; i < VPL_V; ++i) {
        float vf[8];
        if (SHARED_KV) PeVec8<T>::to_float(kr[u][i], vf);
        else PeVec8<T>::to_float(vr[u][SHARED_KV ? 0 : i], vf);
#pragma unroll
        for (int mm = 0; mm < MT; ++mm)
#pragma unroll
          for (int j = 0; j < 8; ++j) acc[mm][i][j] = fmaf(pr[u][mm], vf[j], acc[mm][i][j]);
      }
    }
  }

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
  for (int idx = tid; idx < MT * NV_V; idx += kThreads) {
    const int mm = idx / NV_V;
    const int v = idx - mm * NV_V;
    const int m = m_begin + mm;
    if (m >= m_count) continue;
    const int i_tok = m / G;
    const int h = kvh * G + (m - i_tok * G);
    float M = neg_inf();
#pragma unroll
    for (int g = 0; g < NG; ++g) M = fmaxf(M, s_ml[g][mm][0]);
    float L = 0.f, o[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    if (M != neg_inf()) {
#pragma unroll
      for (int g = 0; g < NG; ++g) {
        const float w = exp2f(s_ml[g][mm][0] - M);
        L += s_ml[g][mm][1] * w;
#pragma unroll
        for (int j = 0; j < 8; ++j) o[j] += s_acc[g][mm][v * 8 + j] * w;
      }
    }
    const float inv = L > 0.f ? 1.f / L : 0.f;
#pragma unroll
    for (int j = 0; j < 8; ++j) o[j] *= inv;
    const int t = q0 + i_tok;
    if (direct) {
      T* dst = static_cast<T*>(p.out) + (int64_t)t * p.out_stride_token + (int64_t)h * p.out_stride_head + v * 8;
      store8<T>(dst, o);
      if (v == 0 && p.lse != nullptr) p.lse[(int64_t)t * Hq + h] = L > 0.f ? (M + log2f(L)) * kLn2 : pos_inf();
    } else {
      const int64_t w = ((int64_t)(p.ws_start[row] + i_tok) * Hq + h) * p.max_splits + split;
      float4* dst = reinterpret_cast<float4*>(p.ws_out + w * DV + v * 8);
      dst[0] = make_float4(o[0], o[1], o[2], o[3]);
      dst[1] = make_float4(o[4], o[5], o[6], o[7]);
      if (v == 0) p.ws_lse[w] = L > 0.f ? M + log2f(L) : neg_inf();
    }
  }
}

// Merges the splits of split rows: grid (rows, kPagedAttnSplitMaxQueryLen, chunks of Hq * DV / 8).
template <typename T>
__global__ void __launch_bounds__(kThreads) paged_attention_combine_kernel(PagedAttentionParams p) {
  const int row = blockIdx.x;
  const int i_tok = blockIdx.y;
  const int q0 = p.query_start_loc[row];
  const int q_len = p.query_start_loc[row + 1] - q0;
  if (i_tok >= q_len) return;
  int nsplit, split_size;
  row_splits(p.context_lens[row], q_len, &nsplit, &split_size);
  if (nsplit == 1) return;
  const int NV = p.head_dim_v / 8;
  const int idx = blockIdx.z * kThreads + threadIdx.x;
  if (idx >= p.num_q_heads * NV) return;
  const int h = idx / NV;
  const int v = idx - h * NV;
  const int64_t w0 = ((int64_t)(p.ws_start[row] + i_tok) * p.num_q_heads + h) * p.max_splits;
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
  const float inv = L > 0.f ? 1.f / L : 0.f;
#pragma unroll
  for (int j = 0; j < 8; ++j) o[j] *= inv;
  const int t = q0 + i_tok;
  T* dst = static_cast<T*>(p.out) + (int64_t)t * p.out_stride_token + (int64_t)h * p.out_stride_head + v * 8;
  store8<T>(dst, o);
  if (v == 0 && p.lse != nullptr) p.lse[(int64_t)t * p.num_q_heads + h] = L > 0.f ? (M + log2f(L)) * kLn2 : pos_inf();
}

template <typename T, int DQK, int DV, int LPT, int MT, int U, bool SHARED_KV>
void launch_main(const PagedAttentionParams& p, peStream_t s) {
  const int G = p.num_q_heads / p.num_kv_heads;
  const int m_tiles = (p.max_query_len * G + MT - 1) / MT;
  const dim3 grid((unsigned)p.max_splits, (unsigned)m_tiles, (unsigned)(p.num_rows * p.num_kv_heads));
  paged_attention_kernel<T, DQK, DV, LPT, MT, U, SHARED_KV><<<grid, kThreads, 0, s>>>(p);
}

template <typename T, int D>
void launch_gqa(const PagedAttentionParams& p, peStream_t s, int mt) {
  constexpr int LPT = D / 8;
  switch (mt) {
    case 1: launch_main<T, D, D, LPT, 1, 4, false>(p, s); break;
    case 2: launch_main<T, D, D, LPT, 2, 4, false>(p, s); break;
    case 4: launch_main<T, D, D, LPT, 4, 4, false>(p, s); break;
    default: launch_main<T, D, D, LPT, 8, 2, false>(p, s); break;
  }
}

template <typename T>
int launch_typed(const PagedAttentionParams& p, peStream_t s) {
  if (p.mla) {
    if (p.head_dim_qk != 576 || p.head_dim_v != 512 || p.num_kv_heads != 1) return -1;
    launch_main<T, 576, 512, 32, 4, 2, true>(p, s);
  } else {
    if (p.head_dim_qk != p.head_dim_v) return -1;
    const int G = p.num_q_heads / p.num_kv_heads;
    int mt = 1;
    while (mt < G && mt < 8) mt *= 2;  // depends on the model only, never on the batch
    switch (p.head_dim_qk) {
      case 64: launch_gqa<T, 64>(p, s, mt); break;
      case 128: launch_gqa<T, 128>(p, s, mt); break;
      case 256: launch_gqa<T, 256>(p, s, mt); break;
      default: return -1;
    }
  }
  if (p.max_splits > 1) {
    const int qmax = p.max_query_len < kPagedAttnSplitMaxQueryLen ? p.max_query_len : kPagedAttnSplitMaxQueryLen;
    const int chunks = (p.num_q_heads * (p.head_dim_v / 8) + kThreads - 1) / kThreads;
    const dim3 grid((unsigned)p.num_rows, (unsigned)qmax, (unsigned)chunks);
    paged_attention_combine_kernel<T><<<grid, kThreads, 0, s>>>(p);
  }
  return 0;
}

}  // namespace

int launch_paged_attention(const PagedAttentionParams& p, void* stream) {
  if (p.num_rows == 0 || p.max_query_len == 0) return 0;
  if (p.num_kv_heads <= 0 || p.num_q_heads % p.num_kv_heads != 0 || p.max_splits < 1) return -1;
  const peStream_t s = static_cast<peStream_t>(stream);
  int rc;
  if (p.dtype == PE_FLOAT16) rc = launch_typed<pe_half>(p, s);
  else if (p.dtype == PE_BFLOAT16) rc = launch_typed<pe_bf16>(p, s);
  else rc = -1;
  if (rc != 0) return rc;
  return static_cast<int>(peGetLastError());
}
