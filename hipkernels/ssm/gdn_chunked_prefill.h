// Chunk-wise Gated DeltaNet prefill (Qwen3-Next / Qwen3.5 linear-attention layers): the recurrence
// of gated_delta_rule.h computed a chunk of tokens at a time (WY / UT form), one state update per
// chunk instead of per token. The kernel lives in gdn_chunked_prefill.hip; the Python wrapper is
// pyengine/ops/cuda/gdn_prefill.py; the spec is the per-token recurrence of
// pyengine/ops/reference/gdn.py, which this equals within fp32 rounding (docs/kernels/gdn_prefill.md).
//
// Per row n and value head hv (key head h = hv / (HV / H)), with S = pool^T [K, V] fp32:
//   S = state[state_idx[n, 0], hv]^T if has_initial_state[n] (null: all true), else zeros
//   for each token t: q = l2norm(q_t) * scale, k = l2norm(k_t)  (l2norm: x * rsqrt(sum x^2 + 1e-6))
//     S = S * exp(g_t);  delta = beta_t (v_t - S^T k);  S = S + k delta^T;  o_t = S^T q
//   state[state_idx[n, 0], hv] = S^T (the final state only)
// A row whose first slot is PAD (-1) writes no state and gets zero output; an empty row does nothing.
// A row's result depends only on its own inputs: each block works on one (row, value head, value
// tile) with a fixed order of arithmetic, whatever the batch.
//
// Layouts: state [num_slots, HV, V, K] fp32 contiguous; q, k [ntok, H, K] and v [ntok, HV, V] with
// token strides (K / V contiguous); g, beta [ntok, HV] fp32 contiguous; out [ntok, HV, V] contiguous
// in the dtype (PeDType) of q / k / v; state_idx [rows, state_idx_stride] (column 0 is read).
#pragma once

#include <cstdint>

constexpr int kGdnPrefillMaxKeyDim = 256;  // K <= 256, a multiple of 4 (<= 128 under hipcc: 64 KB of LDS)

struct GdnChunkedPrefillParams {
  float* state = nullptr;       // [num_slots, HV, V, K]
  const void* q = nullptr;      // [ntok, H, K]
  const void* k = nullptr;      // [ntok, H, K]
  const void* v = nullptr;      // [ntok, HV, V]
  const float* g = nullptr;     // [ntok, HV] log-decay (<= 0)
  const float* beta = nullptr;  // [ntok, HV]
  void* out = nullptr;          // [ntok, HV, V]
  const int32_t* query_start_loc = nullptr;  // [rows + 1]
  const int32_t* state_idx = nullptr;        // [rows, state_idx_stride]
  const bool* has_initial_state = nullptr;   // [rows] or null (all true)
  int num_rows = 0;
  int num_k_heads = 0, num_v_heads = 0, key_dim = 0, value_dim = 0;
  int state_idx_stride = 1;
  int64_t q_stride_token = 0, k_stride_token = 0, v_stride_token = 0;  // in elements
  float scale = 1.f;
  bool l2norm = true;
  int dtype = 0;  // PeDType of q / k / v / out
};

// Tokens per chunk of the build (64 under nvcc, 32 under hipcc); results of the two differ only
// in rounding.
int gdn_chunked_prefill_chunk_size();

// Returns 0 on success, -1 for an unsupported configuration, else the runtime's error code.
int launch_gdn_chunked_prefill(const GdnChunkedPrefillParams& p, void* stream);
