// Gated DeltaNet recurrence of Qwen3-Next / Qwen3.5 linear-attention layers under speculative
// decoding (plain C++ interface; the kernel lives in gated_delta_rule.hip). The PyTorch reference
// with identical semantics is pyengine/ops/reference/gdn.py; the wrappers are in
// pyengine/ops/cuda/gdn.py.
//
// Slots as ssm_state.h: row n holds state_idx[n, 0..S-1] (S = 1 + k, PAD = -1); a = num_accepted[n]
// (>= 1). Per value head hv (key head h = hv / (HV / H)), state S^T [V, K] fp32 in the pool:
//   S = state[idx[n, a - 1], hv] (zeros if PAD); for each token t of the row:
//     q = l2norm(q_t) * scale, k = l2norm(k_t)   (l2norm: x * rsqrt(sum x^2 + 1e-6), when l2norm)
//     S = S * exp(g_t);  delta = beta_t (v_t - S^T k);  S = S + k delta^T;  o_t = S^T q
//     state[idx[n, t], hv] = S (skipped if PAD)
// gated_delta_rule_prefill: the same recurrence from state[idx[n, a - 1]] when has_initial_state[n]
//   (else zeros), writing only the final state, to state[idx[n, 0]] (the reference's chunked form
//   gives the same values within fp32 rounding).
// A row whose first slot is PAD writes nothing and gets zero output.
//
// Layouts: state [num_slots, HV, V, K] fp32 contiguous; q, k [ntok, H, K] and v [ntok, HV, V] with
// token strides (K / V contiguous); g, beta [ntok, HV] fp32 contiguous; out [ntok, HV, V]
// contiguous. dtype (PeDType) is the dtype of q / k / v / out.
#pragma once

#include <cstdint>

constexpr int kGdnMaxKeyDim = 256;  // K <= 256, a multiple of 4
constexpr int kGdnMaxTokens = 16;   // 1 + k <= 16 tokens per decode row

struct GatedDeltaRuleParams {
  float* state = nullptr;    // [num_slots, HV, V, K]
  const void* q = nullptr;   // [ntok, H, K]
  const void* k = nullptr;   // [ntok, H, K]
  const void* v = nullptr;   // [ntok, HV, V]
  const float* g = nullptr;     // [ntok, HV]
  const float* beta = nullptr;  // [ntok, HV]
  void* out = nullptr;          // [ntok, HV, V]
  const int32_t* query_start_loc = nullptr;  // [rows + 1]
  const int32_t* state_idx = nullptr;        // [rows, slots_per_row]
  const int32_t* num_accepted = nullptr;     // [rows]
  const bool* has_initial_state = nullptr;   // prefill: [rows] or null (all true)
  int num_rows = 0;
  int num_k_heads = 0, num_v_heads = 0, key_dim = 0, value_dim = 0;
  int slots_per_row = 1;
  int64_t q_stride_token = 0, k_stride_token = 0, v_stride_token = 0;  // in elements
  float scale = 1.f;
  bool l2norm = true;
  bool final_state_only = false;  // set by launch_gated_delta_rule_prefill
  int dtype = 0;                  // PeDType
};

// Return 0 on success, -1 for an unsupported configuration, else the runtime's error code.
int launch_gated_delta_rule_update(const GatedDeltaRuleParams& p, void* stream);
int launch_gated_delta_rule_prefill(const GatedDeltaRuleParams& p, void* stream);
