// Recurrent-state kernels of Mamba2 layers under speculative decoding (plain C++ interface; the
// kernels live in ssm_state.hip). The PyTorch reference with identical
// semantics is pyengine/ops/reference/ssm.py; the wrappers are in pyengine/ops/cuda/ssm.py.
//
// Slots: row n holds state_idx[n, 0..S-1] (S = 1 + k, PAD = -1); a = num_accepted[n] (>= 1) is the
// number of tokens the row's previous step committed. Row n's tokens are
// [query_start_loc[n], query_start_loc[n+1]). A row whose first slot is PAD writes nothing and gets
// zero output.
//
// causal_conv1d_update (decode / verify, T <= 1 + k tokens per row):
//   line = idx[n, 0], off = a - 1, hist = state[line][off : off + W - 1]
//   y[t] = act(bias + sum_j w[:, j] * concat(hist, x[0..t])[-W:][j])
//   state[line][0 : W - 2 + T] = concat(state[line][off + 1 : off + W - 1], x[0..T-1])
// causal_conv1d_fn (prefill, any length): history = state rows at offset a - 1 when
//   has_initial_state[n], else zeros; same y; afterwards state[line][0 : W - 1] = the last W - 1 rows
//   of concat(history, x).
// selective_state_update (Mamba2, T <= 1 + k tokens per row):
//   s = state[idx[n, a - 1], h] (zeros if PAD); for t: d = softplus(dt + dt_bias) clamped to
//   [dt_min, dt_max]; s = s * exp(A[h] d) + d B[t, g] x[t, h]^T; state[idx[n, t], h] = s (skip PAD);
//   out[t, h] = s C[t, g] + D[h] x[t, h], times silu(z[t, h]) when z is given.
// selective_scan_prefill (varlen prefill rows, any length; the PyTorch reference is the chunked
//   ssd_chunk_scan): the same recurrence from s = state[idx[n, a - 1]] when has_initial_state[n]
//   (else zeros), writing only the final state, to state[idx[n, 0]]; a row with no tokens writes
//   nothing.
//
// Layouts: conv_state [num_slots, S_rows, dim] contiguous (dim fastest); weight [dim, W]; x and y
// [ntok, dim] with a token stride. SSM state [num_slots, H, P, N] fp32 contiguous; x, z, out
// [ntok, H, P] (P contiguous, head stride P), dt [ntok, H], B, C [ntok, G, N] with token strides;
// A, D, dt_bias fp32 [H]. dtype (PeDType) is the dtype of x / y / conv_state / weight / bias / dt /
// B / C / z / out.
#pragma once

#include <cstdint>

constexpr int kSsmMaxConvWidth = 8;  // W <= 8
constexpr int kSsmMaxTokens = 16;    // 1 + k <= 16 tokens per decode row
constexpr int kSsmMaxStateSize = 256;  // N <= 256

struct CausalConv1dParams {
  const void* x = nullptr;  // [ntok, dim]
  void* y = nullptr;        // [ntok, dim]
  void* conv_state = nullptr;  // [num_slots, state_rows, dim]
  const void* weight = nullptr;  // [dim, W]
  const void* bias = nullptr;    // [dim] or null
  const int32_t* query_start_loc = nullptr;  // [rows + 1]
  const int32_t* state_idx = nullptr;        // [rows, slots_per_row]
  const int32_t* num_accepted = nullptr;     // [rows]
  const bool* has_initial_state = nullptr;   // [rows] (prefill only; null = all true)
  int num_rows = 0;
  int dim = 0;
  int width = 4;
  int state_rows = 0;  // S_rows = W - 1 + k
  int slots_per_row = 1;
  int64_t x_stride_token = 0, y_stride_token = 0;  // in elements
  bool silu = true;
  int dtype = 0;  // PeDType
  // causal_conv1d_update, CUDA: a programmatic dependent launch (the kernel reads nothing before
  // the kernel ahead of it in the stream has finished; its launch overlaps that kernel's end)
  bool pdl = true;
};

struct SelectiveStateUpdateParams {
  float* state = nullptr;  // [num_slots, H, P, N]
  const void* x = nullptr;   // [ntok, H, P]
  const void* dt = nullptr;  // [ntok, H]
  const void* B = nullptr;   // [ntok, G, N]
  const void* C = nullptr;   // [ntok, G, N]
  const void* z = nullptr;   // [ntok, H, P] or null
  void* out = nullptr;       // [ntok, H, P] contiguous
  const float* A = nullptr;        // [H]
  const float* D = nullptr;        // [H] or null
  const float* dt_bias = nullptr;  // [H] or null
  const int32_t* query_start_loc = nullptr;
  const int32_t* state_idx = nullptr;
  const int32_t* num_accepted = nullptr;
  int num_rows = 0;
  int num_heads = 0, head_dim = 0, state_size = 0, num_groups = 1;
  int slots_per_row = 1;
  int64_t x_stride_token = 0, dt_stride_token = 0, B_stride_token = 0, C_stride_token = 0, z_stride_token = 0;
  bool dt_softplus = true;
  float dt_min = 0.f, dt_max = 3.0e38f;
  int dtype = 0;  // PeDType
  // prefill only (selective_scan_prefill): [rows] or null = all true; set by the launcher
  const bool* has_initial_state = nullptr;
  bool final_state_only = false;
};

// Return 0 on success, -1 for an unsupported configuration, else the runtime's error code.
int launch_causal_conv1d_update(const CausalConv1dParams& p, void* stream);
int launch_causal_conv1d_fn(const CausalConv1dParams& p, void* stream);
int launch_selective_state_update(const SelectiveStateUpdateParams& p, void* stream);
int launch_selective_scan_prefill(const SelectiveStateUpdateParams& p, void* stream);
