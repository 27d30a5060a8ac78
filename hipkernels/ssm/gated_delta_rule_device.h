// Device building blocks of the Gated DeltaNet kernel (gated_delta_rule.hip, its only includer):
// the lane layout, the per-token update and reductions, and the shared-memory staging of a work
// item's tokens and replayed records.
#pragma once

#include "common/hip_compat.h"
#include "ssm/gated_delta_rule.h"

namespace pe_gdn {

// A group of 8 lanes owns R adjacent value rows, each lane the same 16-byte chunks (sub + 8 j) of
// each. R = 2 (4 warps a tile): the k / q chunks a lane loads per token, and the per-token scalars,
// serve two rows (half the per-element instruction overhead of one row per lane). R = 1 (8 warps a
// tile): half the instructions per warp and token, for small steps, where a token's time is one
// warp's chain of latencies. A row's arithmetic (which lane sums which entries, in which order, the
// butterfly) is the same in both, so are its bits.
constexpr int kLanes = 32;
constexpr int kGroup = 8;  // lanes per group (R value rows)
constexpr int kMaxChunks = kGdnMaxKeyDim / (kGroup * 4);  // 16-byte chunks per lane and row at K = 256

template <int R>
struct Layout {
  static constexpr int kRowsPerLane = R;                    // value rows a lane holds
  static constexpr int kRows = kLanes / kGroup * R;         // value rows per warp
  static constexpr int kWarps = kGdnRecordRows / kRows;
  static constexpr int kThreads = kLanes * kWarps;
  static_assert(kWarps * kRows == kGdnRecordRows, "a block computes exactly one record tile");
};
constexpr int kMaxThreads = Layout<1>::kThreads;

template <int R, int KC>
using Rows = float[R][KC][4];  // a lane's chunks of its value rows

// N sums over the 8 lanes of a group at once (masks < 8); xor butterflies leave every lane of the
// group the same bits, and each value gets the bits it gets reduced alone.
template <int N>
PE_DEVICE void group_sum(float (&x)[N]) {
#pragma unroll
  for (int m = kGroup / 2; m > 0; m /= 2) {
    float y[N];
#pragma unroll
    for (int i = 0; i < N; ++i) y[i] = pe_shfl_xor(x[i], m);
#pragma unroll
    for (int i = 0; i < N; ++i) x[i] = __fadd_rn(x[i], y[i]);
  }
}

// v of lane src (< 8) of this lane's group.
PE_DEVICE float group_lane(float v, int src) {
#if defined(PE_HIP)
  return __shfl(v, src, kGroup);
#else
  return __shfl_sync(0xffffffffu, v, src, kGroup);
#endif
}

// The group sums of a lane's two rows' dots (m: S^T k of rows 0 and 1, then S^T q), each level of the
// butterfly exchanging only the sums this lane keeps (xor 4: the k pair or the q pair, xor 2: a row):
// lane sub ends with m[sub / 2 % 4] summed over the group, 4 shuffles and 4 adds instead of 12 and 12.
// The same additions as group_sum's in the same order (a pairwise sum is commutative), so the same bits.
PE_DEVICE float group_sum_scatter(const float (&m)[4], int sub) {
  const bool q = sub & 4, row1 = sub & 2;
  const float y0 = pe_shfl_xor(q ? m[0] : m[2], 4), y1 = pe_shfl_xor(q ? m[1] : m[3], 4);
  const float a0 = __fadd_rn(q ? m[2] : m[0], y0), a1 = __fadd_rn(q ? m[3] : m[1], y1);
  const float b = __fadd_rn(row1 ? a1 : a0, pe_shfl_xor(row1 ? a0 : a1, 2));
  return __fadd_rn(b, pe_shfl_xor(b, 1));
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

// The raw bits of one or four elements, converted to float only where they are used: a conversion
// right after its load makes the warp wait for that load before it issues the next one.
template <typename T>
PE_DEVICE void load4_raw(const T* p, uint32_t (&w)[4]) {
  if constexpr (sizeof(T) == 4) {
    const uint4 x = *reinterpret_cast<const uint4*>(p);
    w[0] = x.x, w[1] = x.y, w[2] = x.z, w[3] = x.w;
  } else {
    const uint2 x = *reinterpret_cast<const uint2*>(p);
    w[0] = x.x, w[1] = x.y;
  }
}
template <typename T>
PE_DEVICE void raw4_to_float(const uint32_t (&w)[4], float* f) {
  if constexpr (sizeof(T) == 4) {
#pragma unroll
    for (int i = 0; i < 4; ++i) f[i] = __uint_as_float(w[i]);
  } else {
    const uint2 raw = make_uint2(w[0], w[1]);
    const T* h = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) f[i] = Io<T>::ld(h + i);
  }
}
template <typename T>
PE_DEVICE uint32_t load1_raw(const T* p) {
  if constexpr (sizeof(T) == 4)
    return *reinterpret_cast<const uint32_t*>(p);
  else
    return *reinterpret_cast<const uint16_t*>(p);
}
template <typename T>
PE_DEVICE float raw1_to_float(uint32_t w) {
  if constexpr (sizeof(T) == 4) {
    return __uint_as_float(w);
  } else {
    const uint16_t b = static_cast<uint16_t>(w);
    return Io<T>::ld(reinterpret_cast<const T*>(&b));
  }
}

// The two halves of a token's state update, shared by the token loop and the record replay so that
// both compile to the same instructions: S = S * decay, then S = S + k delta^T.
template <int R, int KC>
PE_DEVICE void decay_state(Rows<R, KC>& s, float decay) {
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int j = 0; j < KC; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) s[r][j][i] = __fmul_rn(s[r][j][i], decay);
}

template <int R, int KC>
PE_DEVICE void add_update(Rows<R, KC>& s, const float (&kk)[KC][4], const float (&delta)[R]) {
#pragma unroll
  for (int j = 0; j < KC; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int r = 0; r < R; ++r) s[r][j][i] = fmaf(kk[j][i], delta[r], s[r][j][i]);
}

// The lane's part of a row's dot product: one chain of 4 KC fused multiply-adds (the dots of a
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
  int rlive[kRecords];  // 0: a PAD record slot, not replayed
  int slot[kMaxThreads];  // slot[t] = idx[min(t, S - 1)] of the item's row: where token t >= 1 records
};

// Sums over the warp of N values at once (one reduction's latency for all of them); xor
// butterflies, so each value gets the bits it gets reduced alone.
template <int N>
PE_DEVICE void warp_sum(float (&x)[N]) {
#pragma unroll
  for (int m = kLanes / 2; m > 0; m /= 2) {
    float y[N];
#pragma unroll
    for (int i = 0; i < N; ++i) y[i] = pe_shfl_xor(x[i], m);
#pragma unroll
    for (int i = 0; i < N; ++i) x[i] = __fadd_rn(x[i], y[i]);
  }
}

// A warp's share of one staging round, held in registers between its loads and its stores to
// shared memory, so that every global load of the round (v, g, beta, q, k of the warp's tokens, its
// records) is in flight before the first is used: one memory latency per round, not one per token
// and record (at batch 1 the step is a chain of such latencies). q, k and v stay raw bits until
// stored (converted right after its load, a token's q made the warp wait before the next load).
template <int KC, int R>
struct StageRegs {
  static constexpr int kWarps = Layout<R>::kWarps;
  static constexpr int kc = Staged<KC>::kMaxK / (kLanes * 4);  // 4-float pieces per lane of a q / k row
  static constexpr int kTok = kTokens / kWarps;                // tokens per warp and round
  static constexpr int kRec = (kRecords + kWarps - 1) / kWarps;  // records per warp and round
  static_assert(kTok * kWarps == kTokens, "tokens split evenly over the warps");
  uint32_t v[kTok], q[kTok][kc][4], k[kTok][kc][4];  // raw bits (load*_raw)
  float g[kTok], b[kTok];
  float rk[kRec][kc][4], rdelta[kRec], rdecay[kRec];
  int rslot[kRec];  // the record's slot (-1: PAD, or not this round's)
};

// Token tt of a round is the warp's u-th for tt = warp + u kWarps; record r is warp
// kWarps - 1 - r % kWarps's (the first warps take the extra tokens, the last the records).
template <int R>
PE_DEVICE int token_of(int warp, int u) { return warp + u * Layout<R>::kWarps; }
template <int R>
PE_DEVICE int record_of(int warp, int u) { return Layout<R>::kWarps - 1 - warp + u * Layout<R>::kWarps; }

// The loads of tokens t0 .. t0 + nt - 1 (with_qk: q and k too; a lane holds 4 entries per 128 of K).
// q and k depend on the row and key head alone, so consecutive items of one key head keep them.
template <typename T, int KC, int R>
PE_DEVICE void load_tokens(StageRegs<KC, R>& r, const GatedDeltaRuleParams& p, const T* q, const T* k, const T* v,
                           int64_t t0, int nt, int hv, int tile, int lane, int warp, bool with_qk, int u0, int u1) {
  const int K = p.key_dim, vr = tile * kGdnRecordRows + lane;
#pragma unroll
  for (int u = u0; u < u1; ++u) {
    const int tt = token_of<R>(warp, u);
    const int64_t tok = t0 + tt;
    const bool live = tt < nt;
    r.v[u] = 0, r.g[u] = r.b[u] = 0.f;
    if (live && vr < p.value_dim) r.v[u] = load1_raw(v + tok * p.v_stride_token + vr);
    if (live && lane == 0) r.g[u] = p.g[tok * p.num_v_heads + hv], r.b[u] = p.beta[tok * p.num_v_heads + hv];
#pragma unroll
    for (int j = 0; j < StageRegs<KC, R>::kc; ++j) {
      const int k0 = (lane + j * kLanes) * 4;
#pragma unroll
      for (int i = 0; i < 4; ++i) r.q[u][j][i] = r.k[u][j][i] = 0u;  // zero bits: 0.f in any dtype
      if (live && with_qk && k0 < K) {
        load4_raw(q + tok * p.q_stride_token + k0, r.q[u][j]);
        load4_raw(k + tok * p.k_stride_token + k0, r.k[u][j]);
      }
    }
  }
}

// The loaded tokens into shared memory: v, decay = exp(g), beta and, with_qk, q and k l2-normalised
// (q times scale; zeros past K) and k . q of the scaled vectors. The norms and k . q are warp
// reductions over the raw vectors, the same lanes and order whichever warp and round it is.
template <typename T, int KC, int R>
PE_DEVICE void store_tokens(Staged<KC>& st, const StageRegs<KC, R>& raw, const GatedDeltaRuleParams& p, int nt,
                            int lane, int warp, bool with_qk, int u0, int u1) {
  constexpr int kc = StageRegs<KC, R>::kc, kTok = StageRegs<KC, R>::kTok;
  struct {
    float q[kTok][kc][4], k[kTok][kc][4];
  } r;
#pragma unroll
  for (int u = 0; u < kTok; ++u)
#pragma unroll
    for (int j = 0; j < kc; ++j) raw4_to_float<T>(raw.q[u][j], r.q[u][j]), raw4_to_float<T>(raw.k[u][j], r.k[u][j]);
  float sums[3 * kTok];  // |q|^2, |k|^2, k . q of the tokens u0 .. u1 - 1, reduced together
#pragma unroll
  for (int u = 0; u < kTok; ++u) {
    float qs = 0.f, ks = 0.f, kq = 0.f;
    if (u < u0 || u >= u1) {
      sums[3 * u] = sums[3 * u + 1] = sums[3 * u + 2] = 0.f;
      continue;
    }
#pragma unroll
    for (int j = 0; j < kc; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i)
        qs = fmaf(r.q[u][j][i], r.q[u][j][i], qs), ks = fmaf(r.k[u][j][i], r.k[u][j][i], ks),
        kq = fmaf(r.k[u][j][i], r.q[u][j][i], kq);
    sums[3 * u] = qs, sums[3 * u + 1] = ks, sums[3 * u + 2] = kq;
  }
  if (with_qk) {
    if (u1 - u0 == kTok) {
      warp_sum(sums);
    } else {
#pragma unroll
      for (int u = 0; u < kTok; ++u) {
        if (u < u0 || u >= u1) continue;
        float one[3] = {sums[3 * u], sums[3 * u + 1], sums[3 * u + 2]};
        warp_sum(one);
        sums[3 * u] = one[0], sums[3 * u + 1] = one[1], sums[3 * u + 2] = one[2];
      }
    }
  }
#pragma unroll
  for (int u = u0; u < u1; ++u) {
    const int tt = token_of<R>(warp, u);
    if (tt >= nt) continue;
    st.v[tt][lane] = raw1_to_float<T>(raw.v[u]);
    if (lane == 0) st.tok[tt].x = expf(raw.g[u]), st.tok[tt].y = raw.b[u];
    if (!with_qk) continue;
    const float qs = sums[3 * u], ks = sums[3 * u + 1], kq = sums[3 * u + 2];
    const float qn = p.l2norm ? __fmul_rn(rsqrtf(qs + 1e-6f), p.scale) : p.scale;
    const float kn = p.l2norm ? rsqrtf(ks + 1e-6f) : 1.f;
#pragma unroll
    for (int j = 0; j < kc; ++j) {
      const int k0 = (lane + j * kLanes) * 4;  // zeros past K
      *reinterpret_cast<float4*>(&st.q[tt][k0]) = make_float4(__fmul_rn(r.q[u][j][0], qn), __fmul_rn(r.q[u][j][1], qn),
                                                              __fmul_rn(r.q[u][j][2], qn), __fmul_rn(r.q[u][j][3], qn));
      *reinterpret_cast<float4*>(&st.k[tt][k0]) = make_float4(__fmul_rn(r.k[u][j][0], kn), __fmul_rn(r.k[u][j][1], kn),
                                                              __fmul_rn(r.k[u][j][2], kn), __fmul_rn(r.k[u][j][3], kn));
    }
    if (lane == 0) st.tok[tt].z = __fmul_rn(__fmul_rn(kq, kn), qn);
  }
}

// The slots of records idx[1 + r0 .. r0 + nr] this warp stages (with the row's other metadata, one
// latency before the records themselves); -1 for PAD and for those past nr.
template <int KC, int R>
PE_DEVICE void record_slots(StageRegs<KC, R>& r, const int32_t* idx, int r0, int nr, int warp) {
#pragma unroll
  for (int u = 0; u < StageRegs<KC, R>::kRec; ++u) {
    const int rr = record_of<R>(warp, u);
    r.rslot[u] = rr < nr ? idx[1 + r0 + rr] : -1;
  }
}

// The loads of this tile's part of those records (rec_off inside a slot).
template <int KC, int R>
PE_DEVICE void load_records(StageRegs<KC, R>& r, const GatedDeltaRuleParams& p, int64_t slot_elems, int64_t rec_off,
                            int lane, int u0, int u1) {
  const int K = p.key_dim;
#pragma unroll
  for (int u = u0; u < u1; ++u) {
    const bool live = r.rslot[u] >= 0;
    const float* rec = p.state + (live ? r.rslot[u] : 0) * slot_elems + rec_off;
#pragma unroll
    for (int j = 0; j < StageRegs<KC, R>::kc; ++j) {
      const int k0 = (lane + j * kLanes) * 4;
      if (live && k0 < K) {
        load4(rec + k0, r.rk[u][j]);
      } else {
#pragma unroll
        for (int i = 0; i < 4; ++i) r.rk[u][j][i] = 0.f;
      }
    }
    r.rdelta[u] = live ? rec[K + lane] : 0.f;
    r.rdecay[u] = live && lane == 0 ? rec[K + kGdnRecordRows] : 0.f;
  }
}

// The loaded records into shared memory; a PAD record is marked (rlive), to be skipped by the replay.
template <int KC, int R>
PE_DEVICE void store_records(Staged<KC>& st, const StageRegs<KC, R>& r, int nr, int lane, int warp, int u0, int u1) {
#pragma unroll
  for (int u = u0; u < u1; ++u) {
    const int rr = record_of<R>(warp, u);
    if (rr >= nr) continue;
    if (lane == 0) st.rlive[rr] = r.rslot[u] >= 0;
    if (r.rslot[u] < 0) continue;
#pragma unroll
    for (int j = 0; j < StageRegs<KC, R>::kc; ++j)
      *reinterpret_cast<float4*>(&st.rk[rr][(lane + j * kLanes) * 4]) =
          make_float4(r.rk[u][j][0], r.rk[u][j][1], r.rk[u][j][2], r.rk[u][j][3]);
    st.rdelta[rr][lane] = r.rdelta[u];
    if (lane == 0) st.rdecay[rr] = r.rdecay[u];
  }
}

// A staging round: tokens t0 .. t0 + nt - 1 (none when nt is 0) and records with the slots in sr
// (record_slots). kTogether: every load of the warp in flight before the first store (the latency
// path: one block per item); else a token or record at a time (the persistent grid, where other
// blocks hide the latency and the registers of all of them at once would spill at 5 blocks per SM).
// loaded(): called once the round's loads are issued, before any is used (kTogether; else first).
template <bool kTogether, typename T, int KC, int R, typename Loaded>
PE_DEVICE void stage_round(Staged<KC>& st, StageRegs<KC, R>& sr, const GatedDeltaRuleParams& p, const T* q, const T* k,
                           const T* v, int64_t t0, int nt, int nr, int hv, int tile, int64_t slot_elems,
                           int64_t rec_off, int lane, int warp, bool with_qk, Loaded loaded) {
  constexpr int kTok = StageRegs<KC, R>::kTok, kRec = StageRegs<KC, R>::kRec;
  if constexpr (kTogether) {
    load_tokens(sr, p, q, k, v, t0, nt, hv, tile, lane, warp, with_qk, 0, kTok);
    load_records(sr, p, slot_elems, rec_off, lane, 0, kRec);
    loaded();
    store_tokens<T>(st, sr, p, nt, lane, warp, with_qk, 0, kTok);
    store_records(st, sr, nr, lane, warp, 0, kRec);
  } else {
    loaded();
#pragma unroll
    for (int u = 0; u < kTok; ++u) {
      load_tokens(sr, p, q, k, v, t0, nt, hv, tile, lane, warp, with_qk, u, u + 1);
      store_tokens<T>(st, sr, p, nt, lane, warp, with_qk, u, u + 1);
    }
#pragma unroll
    for (int u = 0; u < kRec; ++u) {
      load_records(sr, p, slot_elems, rec_off, lane, u, u + 1);
      store_records(st, sr, nr, lane, warp, u, u + 1);
    }
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

// The R floats of a staged per-row array at the lane's first row (one 4- or 8-byte load).
template <int R>
PE_DEVICE void load_rows(float (&x)[R], const float* p) {
  if constexpr (R == 2) {
    const float2 f = *reinterpret_cast<const float2*>(p);
    x[0] = f.x, x[1] = f.y;
  } else {
#pragma unroll
    for (int r = 0; r < R; ++r) x[r] = p[r];
  }
}
template <int R>
PE_DEVICE void store_rows(float* p, const float (&x)[R]) {
  if constexpr (R == 2) {
    *reinterpret_cast<float2*>(p) = make_float2(x[0], x[1]);
  } else {
#pragma unroll
    for (int r = 0; r < R; ++r) p[r] = x[r];
  }
}

// Replays staged record r onto the lane's value rows tile_row .. tile_row + R - 1 (rows past V take
// delta 0: never stored; ok: the rows that exist).
template <int R, int KC>
PE_DEVICE void replay_record(Rows<R, KC>& s, const Staged<KC>& st, int r, int sub, int tile_row, const bool (&ok)[R]) {
  float kk[KC][4], d[R];
  load_staged(kk, st.rk[r], sub);
  load_rows(d, &st.rdelta[r][tile_row]);
#pragma unroll
  for (int i = 0; i < R; ++i) d[i] = ok[i] ? d[i] : 0.f;
  decay_state<R>(s, st.rdecay[r]);
  add_update<R>(s, kk, d);
}

// The lane's chunks of its rows that exist (dst: row tile_row; the next row K floats on).
template <int R, int KC>
PE_DEVICE void store_state(float* dst, const Rows<R, KC>& s, int K, int sub, const bool (&ok)[R]) {
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int j = 0; j < KC; ++j)
      if (ok[r] && chunk_k0(sub, j) < K)
        *reinterpret_cast<float4*>(dst + r * K + chunk_k0(sub, j)) =
            make_float4(s[r][j][0], s[r][j][1], s[r][j][2], s[r][j][3]);
}

}  // namespace pe_gdn
