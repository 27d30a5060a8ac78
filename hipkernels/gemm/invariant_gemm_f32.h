// Batch-invariant fp32 GEMM: y[M, N] = x[M, K] @ w[K, N] (+ bias[N]) for every M, with w in the
// [in, out] row-major layout of pyengine/models/layers.py. fp32 storage, fp32 products and sums on
// the CUDA cores (fmaf: each product is exact before its one rounding into the sum; no TF32).
//
// Reduction order. y[m, n] is summed in an order fixed by (K, N, the device's multiprocessor count)
// alone: K is cut into `split` ranges of whole 32-wide k tiles; inside a range one chain
// acc = fmaf(x[m, k], w[k, n], acc) runs from zero over k in increasing order; the ranges' partial
// sums are then added in increasing order ((p0 + p1) + p2 ...), bias last. The row tile (16 or 64
// rows, chosen from M) and how the ranges are spread over blocks (one block per range with a
// workspace and a combine kernel for few output tiles, one block walking every range in turn for
// many) change only who does the work, never an output's operations: a row's result is
// bit-identical alone, in any batch, in a verify step or in a prefill chunk.
//
// No alignment or shape constraints (scalar loads, zero-filled tile edges). Builds with nvcc and
// hipcc (no tensor cores, no clusters).
#pragma once

#include <cstdint>

struct InvariantGemmF32Params {
  const float* x = nullptr;     // [M, K], rows x_stride elements apart, last dim contiguous
  const float* w = nullptr;     // [K, N] row-major, contiguous
  const float* bias = nullptr;  // [N] or nullptr
  float* y = nullptr;           // [M, N], rows y_stride elements apart
  float* workspace = nullptr;   // invariant_gemm_f32_workspace(m, n, k, num_sms, split) floats, or
                                // nullptr where that is 0
  int m = 0, n = 0, k = 0;
  int64_t x_stride = 0, y_stride = 0;  // in elements
  int num_sms = 0;  // multiprocessors of the device: sizes the default split
  int split = 0;    // K ranges (1, 2, 4 or 8, at most the k tiles); 0: invariant_gemm_f32_split(), never from M
};

// The default K split for a (K, N) shape on a device with num_sms multiprocessors.
int invariant_gemm_f32_split(int k, int n, int num_sms);

// fp32 elements of workspace a launch of this shape needs (0: none). split 0: the default.
int64_t invariant_gemm_f32_workspace(int m, int n, int k, int num_sms, int split);

// 0 on success, -1 for a configuration the kernel does not take (a split not listed above, a
// missing workspace, negative sizes), or the runtime's error code.
int launch_invariant_gemm_f32(const InvariantGemmF32Params& p, void* stream);
