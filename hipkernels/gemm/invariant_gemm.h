// Batch-invariant GEMM: y[M, N] = x[M, K] @ w[K, N] (+ bias[N]) on tensor cores, for every M, with
// w in the [in, out] row-major layout of pyengine/models/layers.py. fp16 or bf16 storage (one
// dtype for x, w, bias and y), fp32 accumulation, one rounding on store.
//
// Reduction order. y[m, n] is summed in an order fixed by (K, N, the device's multiprocessor count)
// alone: K is cut into `split` ranges of whole 64-wide k tiles; inside a range the k tiles, and the
// four 16-wide steps of each, are accumulated in increasing order by one mma.sync chain starting
// from zero (the tensor core sums each output of one step in a fixed way, whatever the other rows
// of the fragment hold); the ranges' partial sums are then added in increasing order, bias last.
// The output tile (16, 64 or 128 rows by 32, 64 or 128 columns, chosen from M and the shape)
// changes only which rows share a block, never a row's arithmetic: a row's result is bit-identical
// alone, in any batch, in a verify step or in a prefill chunk. This is the property cuBLAS does not
// give (its kernel and split-K change with M).
//
// split > 1 combines the ranges inside a thread-block cluster (distributed shared memory, sm_90),
// with no workspace. NVIDIA only; launch returns -1 elsewhere. The description above is the
// mma.sync family's (invariant_gemm_kernel.h); on sm_90a builds launch_invariant_gemm runs the wgmma
// family (invariant_gemm_wgmma.h: the same ranges and order, m64n128k16 products, the same bits)
// for shapes whose weight has at least 2^23 elements above 16 or 64 rows, and for smaller ones
// above 256 rows, or kInvariantGemmNarrowRows where their outputs are narrow
// (invariant_gemm_wgmma_default_for).
#pragma once

#include <cstdint>

// Narrow projections: 128-column tiles would give fewer blocks than half the SMs (SmolLM2's). Up to
// kInvariantGemmNarrowRows rows they take the mma.sync family's small tiles (invariant_gemm_tile),
// and those under kInvariantGemmNarrowColumns wide keep that family there rather than wgmma.
constexpr int kInvariantGemmNarrowRows = 768, kInvariantGemmNarrowColumns = 2048;
inline bool invariant_gemm_narrow(int n, int splits, int num_sms) { return 2 * ((n + 127) / 128) * splits < num_sms; }

struct InvariantGemmParams {
  const void* x = nullptr;     // [M, K], rows x_stride elements apart, 16-byte aligned rows
  const void* w = nullptr;     // [K, N] row-major, contiguous, 16-byte aligned
  const void* bias = nullptr;  // [N] or nullptr
  void* y = nullptr;           // [M, N], rows y_stride elements apart
  int m = 0, n = 0, k = 0;     // K a multiple of 64, N a multiple of 8
  int64_t x_stride = 0, y_stride = 0;  // in elements; x_stride a multiple of 8
  int dtype = 0;               // PE_FLOAT16 or PE_BFLOAT16
  int num_sms = 0;             // multiprocessors of the device: sizes the default split
  int split = 0;               // K ranges (1, 2, 4 or 8); 0: invariant_gemm_split(), never from M
  bool pdl = false;            // programmatic dependent launch: the first weight tiles stream in
                               // while the previous kernel of the stream finishes
  int tile_m = 0, tile_n = 0;  // the mma.sync family's output tile: 16 / 64 / 128 rows, 32 / 64 / 128
                               // columns (under 128 with 16 or 64 rows only); 0 the default for the
                               // shape and M. Benchmarks sweep them; no tile changes a bit.
  int family = 0;              // 0: the wgmma family (invariant_gemm_wgmma.h) where the build has it,
                               // M and the weight say (invariant_gemm_wgmma_default_for),
                               // else mma.sync; 1: mma.sync (the grouped GEMM's); 2: wgmma wherever
                               // built (tests, benchmarks). Both give a row the same bits.
};

// The default K split for a (K, N) shape on a device with num_sms multiprocessors.
int invariant_gemm_split(int k, int n, int num_sms);

// 0 on success, -1 for a configuration the kernel does not take (dtype, shapes, alignment, a
// split not listed above, a non-NVIDIA build), or the runtime's error code.
int launch_invariant_gemm(const InvariantGemmParams& p, void* stream);
