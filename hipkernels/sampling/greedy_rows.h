// Greedy sampling's per-row reduction in one kernel (plain C++ interface; the kernel lives in
// greedy_rows.hip). For each fp32 logits row r of [N, V]:
//
//   out[r]     = the first index of the row's maximum, NaN counting above every number (torch.argmax)
//   out[N + r] = 1 if every logit of the row is finite (no NaN, no +-inf), else 0
//
// so that one int64 buffer of 2N values carries both, and one copy brings them to the host
// (pyengine/engine/greedy_sampler.py). It replaces argmax, the finite check (amin, gather, two
// isfinite and an and) and two copies: seven launches a step. Both results are exact (comparisons
// only), so a row's result depends on that row alone, whatever the launch shape or the batch.
#pragma once

#include <cstdint>

struct GreedyRowsParams {
  const float* logits = nullptr;  // [N, V], rows row_stride elements apart (the last dim contiguous)
  int64_t* out = nullptr;         // [2N]: argmax, then finite flags
  int64_t num_rows = 0;           // N
  int64_t vocab = 0;              // V
  int64_t row_stride = 0;         // in elements
};

// 0 on success, -1 for a configuration the kernel does not take (V < 1), or the runtime's error code.
int launch_greedy_rows(const GreedyRowsParams& p, void* stream);
