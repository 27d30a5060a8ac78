// Gated DeltaNet decode / verify update (every token's state to its own slot) and the prefill
// recurrence (final state only). Semantics in gated_delta_rule.h (reference:
// pyengine/ops/reference/gdn.py). All arithmetic in fp32.
//
// Layout as selective_state_update_kernel (ssm_state.hip), whose structure this follows: one block
// per (row, value head, 8 value rows); a 32-lane warp owns two value rows v of S^T [V, K], each
// lane 4 consecutive K entries per 128 (one 16-byte access; K contiguous in the pool) held in
// registers across the row's tokens. Per token the lane loads its q and k entries (l2-normalised
// with a warp reduction), then per value row: decay, the S^T k reduction, the delta update and the
// S^T q reduction (32-lane butterflies, masks < 32: fine on 64-wide AMD wavefronts), and the state
// store. A row's arithmetic never depends on the other rows or on how many tokens share its step:
// token t of a verify row gets the bits the same token gets decoded alone.
#include "common/hip_compat.h"
#include "ssm/gated_delta_rule.h"

namespace {

constexpr int kLanes = 32;
constexpr int kWarps = 4;
constexpr int kRows = 2;  // value rows per warp
constexpr int kChunks = kGdnMaxKeyDim / (kLanes * 4);  // 16-byte K chunks per lane

PE_DEVICE float warp_sum(float x) {
#pragma unroll
  for (int m = kLanes / 2; m > 0; m /= 2) x += pe_shfl_xor(x, m);
  return x;
}

template <typename T>
PE_DEVICE void load4(const T* p, float* f) {
#pragma unroll
  for (int i = 0; i < 4; ++i) f[i] = Io<T>::ld(p + i);
}

template <typename T>
__global__ void __launch_bounds__(kLanes * kWarps) gated_delta_rule_kernel(GatedDeltaRuleParams p) {
  const int lane = threadIdx.x % kLanes;
  const int vr0 = (blockIdx.x * kWarps + threadIdx.x / kLanes) * kRows;  // first value row
  const int hv = blockIdx.y, n = blockIdx.z;
  const int K = p.key_dim, V = p.value_dim, HV = p.num_v_heads;
  if (vr0 >= V) return;  // a whole warp leaves together
  const int rows_here = min(kRows, V - vr0);
  const int s0 = p.query_start_loc[n], num = p.query_start_loc[n + 1] - s0;
  const int32_t* idx = p.state_idx + (int64_t)n * p.slots_per_row;
  T* out = static_cast<T*>(p.out);
  if (idx[0] < 0) {
    if (lane == 0)
      for (int t = 0; t < num; ++t)
        for (int r = 0; r < rows_here; ++r) Io<T>::st(out + ((int64_t)(s0 + t) * HV + hv) * V + vr0 + r, 0.f);
    return;
  }
  const bool init = !p.final_state_only || p.has_initial_state == nullptr || p.has_initial_state[n];
  const int src = init ? idx[max(p.num_accepted[n], 1) - 1] : -1;
  const int64_t slot_elems = (int64_t)HV * V * K;
  const int64_t row_off = ((int64_t)hv * V + vr0) * K;  // value row vr0 of head hv inside a slot
  // Every state load is issued before any is used.
  float s[kRows][kChunks][4];
#pragma unroll
  for (int r = 0; r < kRows; ++r)
#pragma unroll
    for (int j = 0; j < kChunks; ++j) {
      const int k0 = (lane + j * kLanes) * 4;
      if (src >= 0 && r < rows_here && k0 < K) {
        const float4 v4 = *reinterpret_cast<const float4*>(p.state + src * slot_elems + row_off + (int64_t)r * K + k0);
        s[r][j][0] = v4.x, s[r][j][1] = v4.y, s[r][j][2] = v4.z, s[r][j][3] = v4.w;
      } else {
#pragma unroll
        for (int i = 0; i < 4; ++i) s[r][j][i] = 0.f;
      }
    }
  const int hk = hv / (HV / p.num_k_heads);
  const T* q = static_cast<const T*>(p.q) + (int64_t)hk * K;
  const T* k = static_cast<const T*>(p.k) + (int64_t)hk * K;
  const T* v = static_cast<const T*>(p.v) + (int64_t)hv * V + vr0;
  for (int t = 0; t < num; ++t) {
    const int64_t tok = s0 + t;
    float qv[kChunks][4], kv[kChunks][4], qs = 0.f, ks = 0.f;
#pragma unroll
    for (int j = 0; j < kChunks; ++j) {
      const int k0 = (lane + j * kLanes) * 4;
      if (k0 < K) {
        load4(q + tok * p.q_stride_token + k0, qv[j]);
        load4(k + tok * p.k_stride_token + k0, kv[j]);
      } else {
#pragma unroll
        for (int i = 0; i < 4; ++i) qv[j][i] = kv[j][i] = 0.f;
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) qs += qv[j][i] * qv[j][i], ks += kv[j][i] * kv[j][i];
    }
    const float qn = p.l2norm ? rsqrtf(warp_sum(qs) + 1e-6f) * p.scale : p.scale;
    const float kn = p.l2norm ? rsqrtf(warp_sum(ks) + 1e-6f) : 1.f;
    const float decay = expf(p.g[tok * HV + hv]), beta = p.beta[tok * HV + hv];
    float vval[kRows], mem[kRows], o[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      vval[r] = r < rows_here ? Io<T>::ld(v + tok * p.v_stride_token + r) : 0.f;
      mem[r] = 0.f;
#pragma unroll
      for (int j = 0; j < kChunks; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          s[r][j][i] *= decay;
          mem[r] += s[r][j][i] * (kv[j][i] * kn);
        }
    }
#pragma unroll
    for (int r = 0; r < kRows; ++r) mem[r] = warp_sum(mem[r]);
    const int dst = !p.final_state_only ? idx[t] : (t == num - 1 ? idx[0] : -1);
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const float delta = beta * (vval[r] - mem[r]);
      o[r] = 0.f;
#pragma unroll
      for (int j = 0; j < kChunks; ++j) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          s[r][j][i] += (kv[j][i] * kn) * delta;
          o[r] += s[r][j][i] * (qv[j][i] * qn);
        }
        const int k0 = (lane + j * kLanes) * 4;
        if (dst >= 0 && r < rows_here && k0 < K)
          *reinterpret_cast<float4*>(p.state + dst * slot_elems + row_off + (int64_t)r * K + k0) =
              make_float4(s[r][j][0], s[r][j][1], s[r][j][2], s[r][j][3]);
      }
    }
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      o[r] = warp_sum(o[r]);
      if (lane == 0 && r < rows_here) Io<T>::st(out + (tok * HV + hv) * V + vr0 + r, o[r]);
    }
  }
}

template <typename T>
int launch(const GatedDeltaRuleParams& p, peStream_t stream) {
  constexpr int rows_per_block = kWarps * kRows;
  const dim3 grid((p.value_dim + rows_per_block - 1) / rows_per_block, p.num_v_heads, p.num_rows);
  gated_delta_rule_kernel<T><<<grid, kLanes * kWarps, 0, stream>>>(p);
  return static_cast<int>(peGetLastError());
}

}  // namespace

int launch_gated_delta_rule_update(const GatedDeltaRuleParams& p, void* stream) {
  if (p.num_rows == 0) return 0;
  if (p.key_dim <= 0 || p.key_dim > kGdnMaxKeyDim || p.key_dim % 4 != 0 || p.value_dim <= 0 ||
      p.num_k_heads <= 0 || p.num_v_heads % p.num_k_heads != 0 || reinterpret_cast<uintptr_t>(p.state) % 16 != 0 ||
      (!p.final_state_only && p.slots_per_row > kGdnMaxTokens))
    return -1;
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
  return launch_gated_delta_rule_update(q, stream);
}
