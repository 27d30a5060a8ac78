// Skinny GEMM ("GEMV") for decode: y[M, N] = x[M, K] @ w[K, N] (+ bias[N]) for few rows M, with w
// in the [in, out] row-major layout of pyengine/models/layers.py (torch.mm's right operand).
// fp16 or bf16 storage (one dtype for x, w, bias and y), fp32 accumulation, one rounding on store.
//
// Reduction order. Every output element y[m, n] is summed in an order fixed by (K, N, the
// configuration) alone: K is cut into `split` contiguous ranges of 8-row runs; inside a range a
// thread sums its runs in increasing order (8 rows each, one fma per row), the threads of a block
// are combined by a fixed tree, and the ranges are added in increasing order. Nothing depends on
// M or on which rows share the launch, so a row's result is bit-identical alone and in any batch.
//
// split > 1 combines the partial sums inside a thread-block cluster (CUDA, sm_90: distributed
// shared memory), with no workspace and no second kernel; hipcc builds use split = 1.
#pragma once

#include <cstdint>

struct SkinnyGemmParams {
  const void* x = nullptr;     // [M, K], rows x_stride elements apart, 16-byte aligned rows
  const void* w = nullptr;     // [K, N] row-major, contiguous, 16-byte aligned
  const void* bias = nullptr;  // [N] or nullptr
  void* y = nullptr;           // [M, N], rows y_stride elements apart
  int m = 0, n = 0, k = 0;     // K and N multiples of 8
  int64_t x_stride = 0, y_stride = 0;  // in elements
  int dtype = 0;               // PE_FLOAT16 or PE_BFLOAT16
  int num_sms = 0;             // multiprocessors of the device: sizes the default split
  int split = 0;               // K ranges combined per output (1, 2, 4 or 8); 0: skinny_gemm_split()
  int tile_n = 0;              // output columns per block (64 or 128); 0: skinny_gemm_tile_n()
  bool pdl = false;            // programmatic dependent launch (CUDA): the first weights stream in
                               // while the previous kernel of the stream finishes
  const void* prefetch = nullptr;  // CUDA: bytes pulled into L2 once this GEMM's own work is done
  int64_t prefetch_bytes = 0;      // (the next projection's weight, read after a latency-bound kernel)
};

// The default tile width and split for a (K, N) shape on a device with num_sms multiprocessors
// (split 1 under hipcc).
int skinny_gemm_tile_n(int n, int num_sms);
int skinny_gemm_split(int k, int n, int tile_n, int num_sms);

// 0 on success, -1 for a configuration the kernel does not take (dtype, K or N not a multiple of 8,
// a split or tile_n not listed above), or the runtime's error code.
int launch_skinny_gemm(const SkinnyGemmParams& p, void* stream);
