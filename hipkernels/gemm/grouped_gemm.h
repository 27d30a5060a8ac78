// Batch-invariant grouped GEMM: y[r] = x[r] @ w[g(r)] for rows in groups, one [K, N] weight per
// group, w stacked [G, K, N] ([in, out] per group, as pyengine/models/layers.py). The routed
// experts of a MoE layer (rows sorted by expert, group boundaries in a device array) and per-head
// projections (every group the same rows: x [T, H, K] -> y [T, H, N]) are its two forms.
//
// A row's result is bit-identical to invariant_gemm (invariant_gemm.h) of that row alone with its
// group's weight: the same tile kernel, the same K split from (K, N, #SMs), the same order - never a
// function of how many rows the group or the other groups have.
//
// Rows of group g:
//   offs != nullptr (torch._grouped_mm's offs: cumulative row counts, int32 [G] on the device, in
//     the step's memory): rows [offs[g-1], offs[g]) of x [m, K] (offs[-1] = 0), written to the same
//     rows of y. Rows past offs[G-1] are not written. The launch reads no count on the host: its
//     grid is the worst case, ceil(m / BM) + min(G, m) row tiles, and tiles with no rows return.
//   offs == nullptr: every group has m rows; row i of group g is x + g * x_group_stride + i *
//     x_stride, written to y + g * y_group_stride + i * y_stride.
// fp16 or bf16 (one dtype for x, w and y), fp32 accumulation, one rounding. NVIDIA only (mma.sync);
// launch returns -1 elsewhere.
#pragma once

#include <cstdint>

struct GroupedGemmParams {
  const void* x = nullptr;         // rows x_stride elements apart, 16-byte aligned
  const void* w = nullptr;         // [G, K, N] contiguous, 16-byte aligned
  void* y = nullptr;               // rows y_stride elements apart
  const int32_t* offs = nullptr;   // [G] cumulative row counts, or nullptr: m rows in every group
  int num_groups = 0;              // G
  int m = 0, n = 0, k = 0;         // m: x's rows (offs), or rows per group; K a multiple of 64, N of 8
  int64_t x_stride = 0, y_stride = 0;              // elements; x_stride a multiple of 8
  int64_t x_group_stride = 0, y_group_stride = 0;  // elements, offs == nullptr only; x's a multiple of 8
  int dtype = 0;                   // PE_FLOAT16 or PE_BFLOAT16
  int num_sms = 0;                 // multiprocessors of the device: sizes the default split
  int split = 0;                   // K ranges (1, 2, 4 or 8); 0: invariant_gemm_split(K, N, num_sms)
  bool pdl = false;                // programmatic dependent launch (see InvariantGemmParams)
};

// 0 on success, -1 for a configuration the kernel does not take (dtype, shapes, alignment, a
// split not listed above, a grid too tall, a non-NVIDIA build), or the runtime's error code.
int launch_grouped_gemm(const GroupedGemmParams& p, void* stream);
