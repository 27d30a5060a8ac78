// Gated DeltaNet recurrence of Qwen3-Next / Qwen3.5 linear-attention layers under speculative
// decoding (plain C++ interface; the kernel lives in gated_delta_rule.hip). The PyTorch reference
// with identical semantics is pyengine/ops/reference/gdn.py; the wrappers are in
// pyengine/ops/cuda/gdn.py.
//
// Slots: row n holds state_idx[n, 0..S-1] (S = 1 + k, PAD = -1); a = num_accepted[n] clamped to
// 1..S. Per value head hv (key head h = hv / (HV / H)), state S^T [V, K] fp32 in the pool:
//   slot idx[n, 0]   the base: the full state after the previous step's token 0
//   slot idx[n, t]   t >= 1: token t's record (k_t normalised, decay_t = exp(g_t), delta_t), not a state
// gated_delta_rule_update (decode / verify rows):
//   S = state[idx[n, 0], hv]; for j in 1..a-1: replay record idx[n, j] (S = S * decay; S = S + k delta^T;
//   a PAD record slot is skipped); then for each token t of the row:
//     q = l2norm(q_t) * scale, k = l2norm(k_t)   (l2norm: x * rsqrt(sum x^2 + 1e-6), when l2norm)
//     S = S * exp(g_t);  delta = beta_t (v_t - S^T k);  S = S + k delta^T;  o_t = S^T q
//     computed from the state before the token (one pass, see the reference): with decay = exp(g_t),
//     delta = beta_t (v_t - decay S^T k), o_t = decay S^T q + delta (k . q), S = S decay + k delta^T
//     t == 0: state[idx[n, 0], hv] = S;  t >= 1: record (k, exp(g_t), delta) to idx[n, t] (skipped if PAD)
//   One state read and one written per step whatever the row's length; the replay runs the same
//   device functions as the token's own update (decay_state, add_update: explicit fmaf), so the
//   replayed state has the bits the verify step computed.
// gated_delta_rule_prefill: the same base + records (when has_initial_state[n], else zeros), the
//   same per-token recurrence, only the final state written, to state[idx[n, 0]] (the reference's
//   chunked form gives the same values within fp32 rounding).
// gated_delta_rule_materialise: state[replay_dst[n]] = base + records idx[n, 1..a-1] (prefix-caching
//   checkpoint saves of the state after any token of the last step); no tokens.
// A row whose first slot is PAD writes nothing and gets zero output.
//
// Record layout, per slot and value head (the flat [V * K] floats of state[slot, hv]): value rows in
// tiles of kGdnRecordRows; tile c owns gdn_record_width(K) = K + kGdnRecordRows + 4 floats at
// c * gdn_record_width(K): k_t [K] | delta_t of rows c * R + i [R] | decay_t | 3 pad. Needs
// ceil(V / R) * (K + R + 4) <= V * K (at K = V = 128: 656 of 16384 floats).
//
// Why no race: one block computes a (row, value head, tile) item's value rows, and reads and writes
// only that tile's rows of the base and that tile's own record (its private copy of k and decay).
// No other item touches them, so the records this step writes into idx[n, 1..] never overwrite ones
// another block has still to replay. Inside the block every record is read (staged in shared
// memory) before a __syncthreads, and only then does anything get written (each lane its own base
// entries; the tile's record pieces after the tokens, from shared memory). A block that walks
// several items (the persistent grid) does each the same way; the base it prefetches is its next
// item's, which only that item writes.
//
// Layouts: state [num_slots, HV, V, K] fp32 contiguous; q, k [ntok, H, K] and v [ntok, HV, V] with
// token strides (K / V contiguous); g, beta [ntok, HV] fp32 contiguous; out [ntok, HV, V]
// contiguous. dtype (PeDType) is the dtype of q / k / v / out.
#pragma once

#include <cstdint>

constexpr int kGdnMaxKeyDim = 256;  // K <= 256, a multiple of 4
constexpr int kGdnMaxTokens = 16;   // 1 + k <= 16 tokens per decode row
constexpr int kGdnRecordRows = 32;  // value rows per record tile = per block
constexpr int kGdnRecordPad = 4;    // floats after a record's decay (16-byte aligned tiles)
constexpr int gdn_record_width(int key_dim) { return key_dim + kGdnRecordRows + kGdnRecordPad; }

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
  const int32_t* replay_dst = nullptr;       // materialise: [rows] destination slots (PAD: skipped)
  int num_rows = 0;
  int num_k_heads = 0, num_v_heads = 0, key_dim = 0, value_dim = 0;
  int slots_per_row = 1;
  int64_t q_stride_token = 0, k_stride_token = 0, v_stride_token = 0;  // in elements
  float scale = 1.f;
  bool l2norm = true;
  bool final_state_only = false;  // set by launch_gated_delta_rule_prefill
  // K <= 128: 0 picks the grid by the step's size; 1 one block per item, 2 the persistent grid (tests,
  // benchmarks: a row's bits are the same under both)
  int grid = 0;
  int dtype = 0;                  // PeDType
};

// Return 0 on success, -1 for an unsupported configuration, else the runtime's error code.
int launch_gated_delta_rule_update(const GatedDeltaRuleParams& p, void* stream);
int launch_gated_delta_rule_prefill(const GatedDeltaRuleParams& p, void* stream);
int launch_gated_delta_rule_materialise(const GatedDeltaRuleParams& p, void* stream);  // state, state_idx,
                                                                                      // num_accepted, replay_dst
