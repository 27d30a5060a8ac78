// Gated DeltaNet decode / verify update (base state + per-token records), the prefill recurrence
// (final state only) and the materialisation of base + records. Semantics, record layout and the
// race argument in gated_delta_rule.h (reference: pyengine/ops/reference/gdn.py). All arithmetic
// in fp32.
//
// One block per (row, value head, tile of kGdnRecordRows value rows): 8 warps of 4 value rows of
// S^T [V, K]; a group of 8 lanes owns one value row, each lane KC 16-byte chunks of it (lane sub of
// the group: entries (sub + 8 j) * 4 .. + 3, so a group reads a row's 128-byte segments whole; K
// contiguous in the pool), held in registers across the row's tokens. The block issues the base
// loads, stages the row's tokens in shared memory (q and k l2-normalised once per block, decay,
// beta, the tile's v), replays the accepted records, then per token: decay, the S^T k reduction,
// the delta update, the S^T q reduction (8-lane butterflies: 3 shuffles reduce the warp's 4 rows at
// once), and the base (token 0) or the token's record (tokens >= 1) stored. 64 registers and 35 KB
// of shared memory: 4 blocks (32 warps) per SM, so some blocks stream state while others compute.
// A row's arithmetic never depends on the other rows or on how many tokens share its step: token t
// of a verify row gets the bits the same token gets decoded alone, and a replayed record the bits
// its token computed (the same device functions, explicit __fmul_rn / fmaf, no contraction left to
// the compiler).
#include "common/hip_compat.h"
#include "ssm/gated_delta_rule.h"

namespace {

constexpr int kLanes = 32;
constexpr int kGroup = 8;                // lanes per value row
constexpr int kRows = kLanes / kGroup;   // value rows per warp
constexpr int kWarps = kGdnRecordRows / kRows;
constexpr int kMaxChunks = kGdnMaxKeyDim / (kGroup * 4);  // 16-byte chunks per lane at K = 256
static_assert(kWarps * kRows == kGdnRecordRows, "a block computes exactly one record tile");

PE_DEVICE float group_sum(float x) {  // over the 8 lanes of a row (masks < 8: one row's group)
#pragma unroll
  for (int m = kGroup / 2; m > 0; m /= 2) x += pe_shfl_xor(x, m);
  return x;
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
PE_DEVICE void decay_state(float (&s)[KC][4], float decay) {
#pragma unroll
  for (int j = 0; j < KC; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) s[j][i] = __fmul_rn(s[j][i], decay);
}

template <int KC>
PE_DEVICE void add_update(float (&s)[KC][4], const float (&kk)[KC][4], float delta) {
#pragma unroll
  for (int j = 0; j < KC; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) s[j][i] = fmaf(kk[j][i], delta, s[j][i]);
}

PE_DEVICE int chunk_k0(int sub, int j) { return (sub + j * kGroup) * 4; }

// Replays one record (rec: this tile's record inside a slot) onto the lane's value row.
template <int KC>
PE_DEVICE void replay_record(float (&s)[KC][4], const float* rec, int K, int sub, int tile_row, bool row_ok) {
  float kk[KC][4];
#pragma unroll
  for (int j = 0; j < KC; ++j) {
    if (chunk_k0(sub, j) < K) {
      load4(rec + chunk_k0(sub, j), kk[j]);
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i) kk[j][i] = 0.f;
    }
  }
  const float decay = rec[K + kGdnRecordRows];
  const float delta = row_ok ? rec[K + tile_row] : 0.f;
  decay_state(s, decay);
  add_update(s, kk, delta);
}

constexpr int kTokens = 16;  // tokens staged in shared memory at a time (a decode row: all of them)

// Tokens c0 .. c0 + nt - 1 of the row staged for the block: q and k l2-normalised (q times scale),
// decay = exp(g), beta, and v of the tile's value rows. Warp w prepares tokens w, w + 8, ...: a lane
// holds 4 entries per 128 of K and the norms are warp reductions. Every lane of every row then reads
// the same staged values, so the per-token normalisation runs once per block, not once per row.
struct Staged {
  float q[kTokens][kGdnMaxKeyDim], k[kTokens][kGdnMaxKeyDim];
  float v[kTokens][kGdnRecordRows], decay[kTokens], beta[kTokens];
};

PE_DEVICE float warp_sum(float x) {
#pragma unroll
  for (int m = kLanes / 2; m > 0; m /= 2) x += pe_shfl_xor(x, m);
  return x;
}

template <typename T>
PE_DEVICE void stage_tokens(Staged& st, const GatedDeltaRuleParams& p, const T* q, const T* k, const T* v, int64_t t0,
                            int nt, int hv, int tile, int lane, int warp) {
  constexpr int kc = kGdnMaxKeyDim / (kLanes * 4);
  const int K = p.key_dim;
  for (int tt = warp; tt < nt; tt += kWarps) {
    const int64_t tok = t0 + tt;
    float qv[kc][4], kv[kc][4], qs = 0.f, ks = 0.f;
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
      for (int i = 0; i < 4; ++i) qs = fmaf(qv[j][i], qv[j][i], qs), ks = fmaf(kv[j][i], kv[j][i], ks);
    }
    const float qn = p.l2norm ? rsqrtf(warp_sum(qs) + 1e-6f) * p.scale : p.scale;
    const float kn = p.l2norm ? rsqrtf(warp_sum(ks) + 1e-6f) : 1.f;
#pragma unroll
    for (int j = 0; j < kc; ++j) {
      const int k0 = (lane + j * kLanes) * 4;
      if (k0 < K) {
        *reinterpret_cast<float4*>(&st.q[tt][k0]) = make_float4(__fmul_rn(qv[j][0], qn), __fmul_rn(qv[j][1], qn),
                                                                __fmul_rn(qv[j][2], qn), __fmul_rn(qv[j][3], qn));
        *reinterpret_cast<float4*>(&st.k[tt][k0]) = make_float4(__fmul_rn(kv[j][0], kn), __fmul_rn(kv[j][1], kn),
                                                                __fmul_rn(kv[j][2], kn), __fmul_rn(kv[j][3], kn));
      }
    }
    const int vr = tile * kGdnRecordRows + lane;
    st.v[tt][lane] = vr < p.value_dim ? Io<T>::ld(v + tok * p.v_stride_token + vr) : 0.f;
    if (lane == 0) st.decay[tt] = expf(p.g[tok * p.num_v_heads + hv]), st.beta[tt] = p.beta[tok * p.num_v_heads + hv];
  }
}

template <int KC>
PE_DEVICE void load_staged(float (&x)[KC][4], const float* row, int K, int sub) {
#pragma unroll
  for (int j = 0; j < KC; ++j) {
    if (chunk_k0(sub, j) < K) {
      const float4 f = *reinterpret_cast<const float4*>(row + chunk_k0(sub, j));
      x[j][0] = f.x, x[j][1] = f.y, x[j][2] = f.z, x[j][3] = f.w;
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i) x[j][i] = 0.f;
    }
  }
}

template <int KC>
PE_DEVICE void store_state(float* dst, const float (&s)[KC][4], int K, int sub) {
#pragma unroll
  for (int j = 0; j < KC; ++j)
    if (chunk_k0(sub, j) < K)
      *reinterpret_cast<float4*>(dst + chunk_k0(sub, j)) = make_float4(s[j][0], s[j][1], s[j][2], s[j][3]);
}

template <typename T, int KC>
__global__ void __launch_bounds__(kLanes * kWarps, KC <= 4 ? 4 : 1) gated_delta_rule_kernel(GatedDeltaRuleParams p) {
  __shared__ Staged st;
  const int lane = threadIdx.x % kLanes, warp = threadIdx.x / kLanes;
  const int sub = lane % kGroup, tile_row = warp * kRows + lane / kGroup;  // the lane's row in the tile
  const int tile = blockIdx.x, hv = blockIdx.y, n = blockIdx.z;
  const int K = p.key_dim, V = p.value_dim, HV = p.num_v_heads;
  const int vr = tile * kGdnRecordRows + tile_row;  // the lane's value row
  const bool row_ok = vr < V;  // lanes past V compute zeros (and still meet the barriers)
  const bool materialise = p.replay_dst != nullptr;
  const int s0 = materialise ? 0 : p.query_start_loc[n];
  const int num = materialise ? 0 : p.query_start_loc[n + 1] - s0;
  const int32_t* idx = p.state_idx + (int64_t)n * p.slots_per_row;
  T* out = static_cast<T*>(p.out);
  if (idx[0] < 0) {  // the whole block leaves
    if (sub == 0 && row_ok)
      for (int t = 0; t < num; ++t) Io<T>::st(out + ((int64_t)(s0 + t) * HV + hv) * V + vr, 0.f);
    return;
  }
  const bool init = !p.final_state_only || p.has_initial_state == nullptr || p.has_initial_state[n];
  const int a = min(max(p.num_accepted[n], 1), p.slots_per_row);
  const int64_t slot_elems = (int64_t)HV * V * K;
  const int64_t row_off = ((int64_t)hv * V + vr) * K;  // the lane's value row inside a slot
  const int64_t rec_off = (int64_t)hv * V * K + (int64_t)tile * (K + kGdnRecordRows + kGdnRecordPad);
  // The base: every load issued before any is used.
  float s[KC][4];
#pragma unroll
  for (int j = 0; j < KC; ++j) {
    if (init && row_ok && chunk_k0(sub, j) < K) {
      load4(p.state + idx[0] * slot_elems + row_off + chunk_k0(sub, j), s[j]);
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i) s[j][i] = 0.f;
    }
  }
  const int hk = hv / (HV / p.num_k_heads);
  const T* q = static_cast<const T*>(p.q) + (int64_t)hk * K;
  const T* k = static_cast<const T*>(p.k) + (int64_t)hk * K;
  const T* v = static_cast<const T*>(p.v) + (int64_t)hv * V;
  if (num > 0) stage_tokens(st, p, q, k, v, s0, min(num, kTokens), hv, tile, lane, warp);
  if (init)
    for (int j = 1; j < a; ++j)
      if (idx[j] >= 0) replay_record(s, p.state + idx[j] * slot_elems + rec_off, K, sub, tile_row, row_ok);
  // every record of the previous step read by every warp before this step writes any; tokens staged
  __syncthreads();
  if (materialise) {
    if (p.replay_dst[n] >= 0 && row_ok) store_state(p.state + p.replay_dst[n] * slot_elems + row_off, s, K, sub);
    return;
  }
  for (int c0 = 0; c0 < num; c0 += kTokens) {
    if (c0 > 0) {  // a prefill row's next tokens: restage once every warp is done with these
      __syncthreads();
      stage_tokens(st, p, q, k, v, s0 + c0, min(num - c0, kTokens), hv, tile, lane, warp);
      __syncthreads();
    }
    for (int tt = 0; tt < min(num - c0, kTokens); ++tt) {
      const int t = c0 + tt;
      float qq[KC][4], kk[KC][4];
      load_staged(kk, st.k[tt], K, sub);
      load_staged(qq, st.q[tt], K, sub);
      const float decay = st.decay[tt];
      decay_state(s, decay);
      float mem = 0.f;
#pragma unroll
      for (int j = 0; j < KC; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) mem = fmaf(s[j][i], kk[j][i], mem);
      const float delta = __fmul_rn(st.beta[tt], __fsub_rn(st.v[tt][tile_row], group_sum(mem)));
      add_update(s, kk, delta);
      float o = 0.f;
#pragma unroll
      for (int j = 0; j < KC; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) o = fmaf(s[j][i], qq[j][i], o);
      // token 0 (and a prefill row's last token): the full state to idx[0]; tokens >= 1: their record
      const bool base = p.final_state_only ? t == num - 1 : t == 0;
      const int dst = p.final_state_only || t >= p.slots_per_row ? -1 : idx[t];
      if (base) {
        if (row_ok) store_state(p.state + idx[0] * slot_elems + row_off, s, K, sub);
      } else if (dst >= 0) {
        float* rec = p.state + dst * slot_elems + rec_off;
        if (tile_row == 0) store_state(rec, kk, K, sub);  // lanes 0..7 of warp 0: the tile's k copy
        if (tile_row == 0 && sub == 0) rec[K + kGdnRecordRows] = decay;
        if (sub == 0 && row_ok) rec[K + tile_row] = delta;
      }
      o = group_sum(o);
      if (sub == 0 && row_ok) Io<T>::st(out + ((int64_t)(s0 + t) * HV + hv) * V + vr, o);
    }
  }
}

template <typename T>
int launch(const GatedDeltaRuleParams& p, peStream_t stream) {
  const dim3 grid((p.value_dim + kGdnRecordRows - 1) / kGdnRecordRows, p.num_v_heads, p.num_rows);
  if (p.key_dim <= 4 * kGroup * 4)  // K <= 128: half the registers
    gated_delta_rule_kernel<T, 4><<<grid, kLanes * kWarps, 0, stream>>>(p);
  else
    gated_delta_rule_kernel<T, kMaxChunks><<<grid, kLanes * kWarps, 0, stream>>>(p);
  return static_cast<int>(peGetLastError());
}

bool aligned(const void* ptr, int64_t stride_elems, int elem_bytes) {  // 4 elements: one 8- or 16-byte load
  return reinterpret_cast<uintptr_t>(ptr) % (4 * elem_bytes) == 0 && stride_elems % 4 == 0;
}

bool supported(const GatedDeltaRuleParams& p) {
  const int tiles = (p.value_dim + kGdnRecordRows - 1) / kGdnRecordRows;
  return p.key_dim > 0 && p.key_dim <= kGdnMaxKeyDim && p.key_dim % 4 == 0 && p.value_dim > 0 &&
         p.num_k_heads > 0 && p.num_v_heads % p.num_k_heads == 0 && reinterpret_cast<uintptr_t>(p.state) % 16 == 0 &&
         p.slots_per_row >= 1 && (int64_t)tiles * gdn_record_width(p.key_dim) <= (int64_t)p.value_dim * p.key_dim;
}

}  // namespace

int launch_gated_delta_rule_update(const GatedDeltaRuleParams& p, void* stream) {
  if (p.num_rows == 0) return 0;
  if (!supported(p) || (!p.final_state_only && p.slots_per_row > kGdnMaxTokens)) return -1;
  const int elem = p.dtype == PE_FLOAT32 ? 4 : 2;  // q / k rows are read 4 elements at a time
  if (!aligned(p.q, p.q_stride_token, elem) || !aligned(p.k, p.k_stride_token, elem)) return -1;
  const peStream_t s = static_cast<peStream_t>(stream);
  switch (p.dtype) {
    case PE_FLOAT32: return launch<float>(p, s);
    case PE_FLOAT16: return launch<pe_half>(p, s);
    case PE_BFLOAT16: return launch<pe_bf16>(p, s);
    default: return -1;
  }
}

int launch_gated_delta_rule_prefill(const GatedDeltaRuleParams& p, void* stream) {
  GatedDeltaRuleParams q = p;
  q.final_state_only = true;
  q.replay_dst = nullptr;
  return launch_gated_delta_rule_update(q, stream);
}

int launch_gated_delta_rule_materialise(const GatedDeltaRuleParams& p, void* stream) {
  if (p.num_rows == 0) return 0;
  if (!supported(p) || p.replay_dst == nullptr) return -1;
  GatedDeltaRuleParams q = p;
  q.final_state_only = false;
  return launch<float>(q, static_cast<peStream_t>(stream));
}
