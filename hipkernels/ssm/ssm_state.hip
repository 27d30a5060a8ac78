// Selective state update of Mamba2 layers (multi-token, slot per token; with final_state_only,
// the prefill scan). Semantics in ssm_state.h (reference: pyengine/ops/reference/ssm.py). All
// arithmetic in fp32. The conv kernels are in causal_conv1d.hip.
//
// selective_state_update (and, writing only the final state, the prefill scan: one token after
// the other in registers, correct first; the chunked tensor-core form is future work): one block
// per (row, head, 8 head-dim rows); a 32-lane group owns two
// head-dim rows, each lane 4 consecutive state entries per 128 (one 16-byte access) in registers
// across the row's tokens, so B, C and dt are loaded once for two rows and every state load is in
// flight before the first is used; the output dot product is a 32-lane butterfly reduction (fine
// on 64-wide AMD wavefronts: masks < 32).
#include "common/hip_compat.h"
#include "ssm/ssm_state.h"
#include "ssm/ssm_vec.h"

namespace {

using namespace pe_ssm;

constexpr int kLanes = 32;
constexpr int kWarpsPerBlock = 4;
constexpr int kRowsPerWarp = 2;

template <typename T, int V>
__global__ void __launch_bounds__(kLanes * kWarpsPerBlock) selective_state_update_kernel(SelectiveStateUpdateParams p) {
  constexpr int J = kSsmMaxStateSize / (kLanes * V);  // state chunks per lane
  const int lane = threadIdx.x % kLanes;
  const int pr0 = (blockIdx.x * kWarpsPerBlock + threadIdx.x / kLanes) * kRowsPerWarp;  // first head-dim row
  const int h = blockIdx.y, n = blockIdx.z;
  if (pr0 >= p.head_dim) return;  // a whole warp leaves together
  const int H = p.num_heads, P = p.head_dim, N = p.state_size;
  const int rows_here = min(kRowsPerWarp, P - pr0);
  const int s0 = p.query_start_loc[n], num = p.query_start_loc[n + 1] - s0;
  const int32_t* idx = p.state_idx + (int64_t)n * p.slots_per_row;
  T* out = static_cast<T*>(p.out);
  if (idx[0] < 0) {
    if (lane == 0)
      for (int t = 0; t < num; ++t)
        for (int r = 0; r < rows_here; ++r) Io<T>::st(out + ((int64_t)(s0 + t) * H + h) * P + pr0 + r, 0.f);
    return;
  }
  const bool init = !p.final_state_only || p.has_initial_state == nullptr || p.has_initial_state[n];
  const int src = init ? idx[max(p.num_accepted[n], 1) - 1] : -1;
  const int64_t row_off = ((int64_t)h * P + pr0) * N;  // row pr0 of head h inside a slot
  const int64_t slot_elems = (int64_t)H * P * N;
  // All state loads are issued before any is used, so each thread has R * J loads in flight.
  float s[kRowsPerWarp][J][V];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r)
#pragma unroll
    for (int j = 0; j < J; ++j) {
      const int k0 = (lane + j * kLanes) * V;
      if (src >= 0 && r < rows_here && k0 < N) {
        ChanVec<float, V>::ld(p.state + src * slot_elems + row_off + (int64_t)r * N + k0, s[r][j]);
      } else {
#pragma unroll
        for (int i = 0; i < V; ++i) s[r][j][i] = 0.f;
      }
    }
  const int g = h / (H / p.num_groups);
  const float a_h = p.A[h];
  const float d_h = p.D ? p.D[h] : 0.f;
  const float bias = p.dt_bias ? p.dt_bias[h] : 0.f;
  const T* x = static_cast<const T*>(p.x);
  const T* B = static_cast<const T*>(p.B);
  const T* C = static_cast<const T*>(p.C);
  for (int t = 0; t < num; ++t) {
    const int64_t tok = s0 + t;
    float d = Io<T>::ld(static_cast<const T*>(p.dt) + tok * p.dt_stride_token + h) + bias;
    const T* b_t = B + tok * p.B_stride_token + (int64_t)g * N;
    const T* c_t = C + tok * p.C_stride_token + (int64_t)g * N;
    float xv[kRowsPerWarp], partial[kRowsPerWarp];
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
      xv[r] = r < rows_here ? Io<T>::ld(x + tok * p.x_stride_token + (int64_t)h * P + pr0 + r) : 0.f;
      partial[r] = 0.f;
    }
    if (p.dt_softplus) d = d > 20.f ? d : log1pf(expf(d));
    d = fminf(fmaxf(d, p.dt_min), p.dt_max);
    const float decay = expf(a_h * d);
    const int dst = !p.final_state_only ? idx[t] : (t == num - 1 ? idx[0] : -1);
#pragma unroll
    for (int j = 0; j < J; ++j) {
      const int k0 = (lane + j * kLanes) * V;
      if (k0 >= N) continue;
      float bk[V], ck[V];
#pragma unroll
      for (int i = 0; i < V; ++i) {
        bk[i] = d * Io<T>::ld(b_t + k0 + i);
        ck[i] = Io<T>::ld(c_t + k0 + i);
      }
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) {
        if (r >= rows_here) continue;
#pragma unroll
        for (int i = 0; i < V; ++i) {
          s[r][j][i] = s[r][j][i] * decay + bk[i] * xv[r];
          partial[r] += s[r][j][i] * ck[i];
        }
        if (dst >= 0) ChanVec<float, V>::st(p.state + dst * slot_elems + row_off + (int64_t)r * N + k0, s[r][j]);
      }
    }
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
#pragma unroll
      for (int m = kLanes / 2; m > 0; m /= 2) partial[r] += pe_shfl_xor(partial[r], m);
      if (lane == 0 && r < rows_here) {
        float yv = partial[r] + d_h * xv[r];
        if (p.z) {
          const float zv = Io<T>::ld(static_cast<const T*>(p.z) + tok * p.z_stride_token + (int64_t)h * P + pr0 + r);
          yv *= silu(zv);
        }
        Io<T>::st(out + (tok * H + h) * P + pr0 + r, yv);
      }
    }
  }
}

template <typename T>
struct SsmUpdate {
  static int run(const SelectiveStateUpdateParams& p, peStream_t s) {
    constexpr int rows_per_block = kWarpsPerBlock * kRowsPerWarp;
    const dim3 grid((p.head_dim + rows_per_block - 1) / rows_per_block, p.num_heads, p.num_rows);
    const bool vec4 = p.state_size % 4 == 0 && reinterpret_cast<uintptr_t>(p.state) % 16 == 0;
    if (vec4) selective_state_update_kernel<T, 4><<<grid, kLanes * kWarpsPerBlock, 0, s>>>(p);
    else selective_state_update_kernel<T, 1><<<grid, kLanes * kWarpsPerBlock, 0, s>>>(p);
    return static_cast<int>(peGetLastError());
  }
};

}  // namespace

int launch_selective_state_update(const SelectiveStateUpdateParams& p, void* stream) {
  if (p.num_rows == 0) return 0;
  if (p.state_size <= 0 || p.state_size > kSsmMaxStateSize || p.num_groups <= 0 ||
      p.num_heads % p.num_groups != 0 || p.head_dim <= 0 || p.slots_per_row > kSsmMaxTokens)
    return -1;
  return dispatch<SsmUpdate>(p, stream);
}

int launch_selective_scan_prefill(const SelectiveStateUpdateParams& p, void* stream) {
  SelectiveStateUpdateParams q = p;
  q.final_state_only = true;
  return launch_selective_state_update(q, stream);
}
