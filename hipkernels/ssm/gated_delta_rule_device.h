// Device building blocks of the Gated DeltaNet kernel (gated_delta_rule.hip, its only includer):
// the lane layout, the per-token update and reductions, and the shared-memory staging of a work
// item's tokens and replayed records.
#pragma once

#include "common/hip_compat.h"
#include "ssm/gated_delta_rule.h"

namespace pe_gdn {

// A group of 8 lanes owns two adjacent value rows (2 p, 2 p + 1 of the tile), each lane the same
// 16-byte chunks of both: the k / q chunks a lane loads per token, and the per-token scalars, serve
// two rows (the per-element instruction overhead of a token halves next to one row per lane).
constexpr int kLanes = 32;
constexpr int kGroup = 8;                             // lanes per pair of value rows
constexpr int kRowsPerLane = 2;                       // value rows a lane holds
constexpr int kRows = kLanes / kGroup * kRowsPerLane;  // value rows per warp
constexpr int kWarps = kGdnRecordRows / kRows;
constexpr int kMaxChunks = kGdnMaxKeyDim / (kGroup * 4);  // 16-byte chunks per lane and row at K = 256
constexpr int kThreads = kLanes * kWarps;
static_assert(kWarps * kRows == kGdnRecordRows, "a block computes exactly one record tile");

template <int KC>
using RowPair = float[kRowsPerLane][KC][4];  // a lane's chunks of its two value rows

// Four sums over the 8 lanes of a group at once (masks < 8); xor butterflies leave every lane of the
// group the same bits.
PE_DEVICE void group_sum4(float& a, float& b, float& c, float& d) {
#pragma unroll
  for (int m = kGroup / 2; m > 0; m /= 2) {
    const float w = pe_shfl_xor(a, m), x = pe_shfl_xor(b, m), y = pe_shfl_xor(c, m), z = pe_shfl_xor(d, m);
    a = __fadd_rn(a, w), b = __fadd_rn(b, x), c = __fadd_rn(c, y), d = __fadd_rn(d, z);
  }
}

// Four consecutive elements, one 8- or 16-byte load (the wrapper aligns q / k rows to 4 elements).
PE_DEVICE void load4(const float* p, float* f) {
  const float4 v = *reinterpret_cast<const float4*>(p);
  f[0] = v.x, f[1] = v.y, f[2] = v.z, f[3] = v.w;
}
template <typename T>
PE_DEVICE void load4(const T* p, float* f) {
  const uint2 raw = *reinterpret_cast<const uint2*>(p);
  const T* h = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) f[i] = Io<T>::ld(h + i);
}

// The two halves of a token's state update, shared by the token loop and the record replay so that
// both compile to the same instructions: S = S * decay, then S = S + k delta^T.
template <int KC>
PE_DEVICE void decay_state(RowPair<KC>& s, float decay) {
#pragma unroll
  for (int r = 0; r < kRowsPerLane; ++r)
#pragma unroll
    for (int j = 0; j < KC; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) s[r][j][i] = __fmul_rn(s[r][j][i], decay);
}

template <int KC>
PE_DEVICE void add_update(RowPair<KC>& s, const float (&kk)[KC][4], float delta0, float delta1) {
#pragma unroll
  for (int j = 0; j < KC; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      s[0][j][i] = fmaf(kk[j][i], delta0, s[0][j][i]);
      s[1][j][i] = fmaf(kk[j][i], delta1, s[1][j][i]);
    }
}

// The lane's part of a row's dot product: one chain of 4 KC fused multiply-adds (the four dots of a
// token are independent chains: enough to keep the pipe busy without partial sums to add up).
template <int KC>
PE_DEVICE float dot_part(const float (&s)[KC][4], const float (&x)[KC][4]) {
  float acc = __fmul_rn(s[0][0], x[0][0]);
#pragma unroll
  for (int j = 0; j < KC; ++j)
#pragma unroll
    for (int i = j == 0 ? 1 : 0; i < 4; ++i) acc = fmaf(s[j][i], x[j][i], acc);
  return acc;
}

PE_DEVICE int chunk_k0(int sub, int j) { return (sub + j * kGroup) * 4; }

// Shared memory of a block: tokens c0 .. c0 + nt - 1 of the row, q and k l2-normalised (q times
// scale; zeros past K, so that per-token loads need no bounds), k . q, decay = exp(g), beta, v of
// the tile's value rows, and the tokens' outputs and deltas (written out once per chunk of tokens,
// coalesced); and the tile's part of the records it replays (k, the tile's deltas, decay). Every
// lane of every row reads the same staged values, so the per-token normalisation runs once per
// block, not once per row. 8 tokens and 7 records at a time (16 KB at K = 128; with the prefetch
// buffer 32 KB a block).
constexpr int kTokens = 8;
constexpr int kRecords = 7;

template <int KC>
struct Staged {
  static constexpr int kMaxK = KC * kGroup * 4;
  float q[kTokens][kMaxK], k[kTokens][kMaxK], rk[kRecords][kMaxK];
  float v[kTokens][kGdnRecordRows], o[kTokens][kGdnRecordRows], delta[kTokens][kGdnRecordRows];
  float rdelta[kRecords][kGdnRecordRows];
  float4 tok[kTokens];  // decay = exp(g), beta, k . q (of the scaled vectors), unused: one load per token
  float rdecay[kRecords];
};

// Three sums over the warp at once (one reduction's latency).
PE_DEVICE void warp_sum3(float& a, float& b, float& c) {
#pragma unroll
  for (int m = kLanes / 2; m > 0; m /= 2) {
    const float x = pe_shfl_xor(a, m), y = pe_shfl_xor(b, m), z = pe_shfl_xor(c, m);
    a = __fadd_rn(a, x), b = __fadd_rn(b, y), c = __fadd_rn(c, z);
  }
}

// Warp w prepares tokens w, w + kWarps, ...: v, decay, beta (every load of the warp in flight before
// the first is stored) and, with_qk, q and k (a lane holds 4 entries per 128 of K; the norms and
// k . q, of the raw vectors then scaled by both norms, are warp reductions, the same lanes and order
// whichever warp it is). q and k depend on the row and key head alone, so consecutive items of one
// key head keep them.
template <typename T, int KC>
PE_DEVICE void stage_tokens(Staged<KC>& st, const GatedDeltaRuleParams& p, const T* q, const T* k, const T* v,
                            int64_t t0, int nt, int hv, int tile, int lane, int warp, bool with_qk) {
  constexpr int kc = Staged<KC>::kMaxK / (kLanes * 4);
  constexpr int kPer = kTokens / kWarps;
  static_assert(kPer * kWarps == kTokens, "tokens split evenly over the warps");
  const int K = p.key_dim, vr = tile * kGdnRecordRows + lane;
  float vv[kPer], gg[kPer], bb[kPer];
#pragma unroll
  for (int u = 0; u < kPer; ++u) {
    const int tt = warp + u * kWarps;
    const int64_t tok = t0 + tt;
    vv[u] = tt < nt && vr < p.value_dim ? Io<T>::ld(v + tok * p.v_stride_token + vr) : 0.f;
    gg[u] = tt < nt && lane == 0 ? p.g[tok * p.num_v_heads + hv] : 0.f;
    bb[u] = tt < nt && lane == 0 ? p.beta[tok * p.num_v_heads + hv] : 0.f;
  }
#pragma unroll
  for (int u = 0; u < kPer; ++u) {
    const int tt = warp + u * kWarps;
    if (tt >= nt) continue;
    st.v[tt][lane] = vv[u];
    if (lane == 0) st.tok[tt].x = expf(gg[u]), st.tok[tt].y = bb[u];
  }
  if (!with_qk) return;
  for (int tt = warp; tt < nt; tt += kWarps) {
    const int64_t tok = t0 + tt;
    float qv[kc][4], kv[kc][4], qs = 0.f, ks = 0.f, kq = 0.f;
#pragma unroll
    for (int j = 0; j < kc; ++j) {
      const int k0 = (lane + j * kLanes) * 4;
      if (k0 < K) {
        load4(q + tok * p.q_stride_token + k0, qv[j]);
        load4(k + tok * p.k_stride_token + k0, kv[j]);
      } else {
#pragma unroll
        for (int i = 0; i < 4; ++i) qv[j][i] = kv[j][i] = 0.f;
      }
#pragma unroll
      for (int i = 0; i < 4; ++i)
        qs = fmaf(qv[j][i], qv[j][i], qs), ks = fmaf(kv[j][i], kv[j][i], ks), kq = fmaf(kv[j][i], qv[j][i], kq);
    }
    warp_sum3(qs, ks, kq);
    const float qn = p.l2norm ? __fmul_rn(rsqrtf(qs + 1e-6f), p.scale) : p.scale;
    const float kn = p.l2norm ? rsqrtf(ks + 1e-6f) : 1.f;
#pragma unroll
    for (int j = 0; j < kc; ++j) {
      const int k0 = (lane + j * kLanes) * 4;  // zeros past K
      *reinterpret_cast<float4*>(&st.q[tt][k0]) = make_float4(__fmul_rn(qv[j][0], qn), __fmul_rn(qv[j][1], qn),
                                                              __fmul_rn(qv[j][2], qn), __fmul_rn(qv[j][3], qn));
      *reinterpret_cast<float4*>(&st.k[tt][k0]) = make_float4(__fmul_rn(kv[j][0], kn), __fmul_rn(kv[j][1], kn),
                                                              __fmul_rn(kv[j][2], kn), __fmul_rn(kv[j][3], kn));
    }
    if (lane == 0) st.tok[tt].z = __fmul_rn(__fmul_rn(kq, kn), qn);
  }
}

// Records idx[1 + r0 .. r0 + nr] of this tile (rec_off inside a slot) into shared memory, record r
// by warp kWarps - 1 - r % kWarps (the first warps stage the tokens first). A PAD slot is neither
// staged nor replayed.
template <int KC>
PE_DEVICE void stage_records(Staged<KC>& st, const GatedDeltaRuleParams& p, const int32_t* idx, int64_t slot_elems,
                             int64_t rec_off, int r0, int nr, int lane, int warp) {
  constexpr int kc = Staged<KC>::kMaxK / (kLanes * 4);
  const int K = p.key_dim;
  for (int r = kWarps - 1 - warp; r < nr; r += kWarps) {
    const int slot = idx[1 + r0 + r];
    if (slot < 0) continue;
    const float* rec = p.state + slot * slot_elems + rec_off;
#pragma unroll
    for (int j = 0; j < kc; ++j) {
      const int k0 = (lane + j * kLanes) * 4;
      *reinterpret_cast<float4*>(&st.rk[r][k0]) =
          k0 < K ? *reinterpret_cast<const float4*>(rec + k0) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    st.rdelta[r][lane] = rec[K + lane];
    if (lane == 0) st.rdecay[r] = rec[K + kGdnRecordRows];
  }
}

template <int KC>
PE_DEVICE void load_staged(float (&x)[KC][4], const float* row, int sub) {  // zeros past K are staged
#pragma unroll
  for (int j = 0; j < KC; ++j) {
    const float4 f = *reinterpret_cast<const float4*>(row + chunk_k0(sub, j));
    x[j][0] = f.x, x[j][1] = f.y, x[j][2] = f.z, x[j][3] = f.w;
  }
}

// Replays staged record r onto the lane's value rows tile_row, tile_row + 1 (rows past V take delta 0:
// never stored).
template <int KC>
PE_DEVICE void replay_record(RowPair<KC>& s, const Staged<KC>& st, int r, int sub, int tile_row, bool ok0, bool ok1) {
  float kk[KC][4];
  load_staged(kk, st.rk[r], sub);
  const float2 d = *reinterpret_cast<const float2*>(&st.rdelta[r][tile_row]);
  decay_state(s, st.rdecay[r]);
  add_update(s, kk, ok0 ? d.x : 0.f, ok1 ? d.y : 0.f);
}

// The lane's chunks of its rows that exist (dst: row tile_row; the next row K floats on).
template <int KC>
PE_DEVICE void store_state(float* dst, const RowPair<KC>& s, int K, int sub, bool ok0, bool ok1) {
#pragma unroll
  for (int r = 0; r < kRowsPerLane; ++r)
#pragma unroll
    for (int j = 0; j < KC; ++j)
      if ((r == 0 ? ok0 : ok1) && chunk_k0(sub, j) < K)
        *reinterpret_cast<float4*>(dst + r * K + chunk_k0(sub, j)) =
            make_float4(s[r][j][0], s[r][j][1], s[r][j][2], s[r][j][3]);
}

}  // namespace pe_gdn
