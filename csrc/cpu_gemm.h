// bf16 GEMM for CPU decode: y[M, N] = x[M, K] @ W[K, N] (+ bias), weights packed once at load.
//
// Why not oneDNN: at decode sizes (M of 1 to a few dozen rows) the step streams every weight once,
// and oneDNN's bf16 kernels reached ~21 GB/s of the machine's ~30 (SmolLM2, 2 cores); its kernel
// choice also depends on M, so a row's result could change with the batch around it. Here a row's
// output is the same k-ordered sum of vdpbf16ps products for any M (rows are independent and the
// packing fixes the order), which keeps bf16 greedy speculation identical to plain decoding.
//
// Layout: 16-column panels; within a panel, for each pair of k, the 16 columns' (w[2k], w[2k+1])
// pairs: one 64-byte line feeds 16 vdpbf16ps (one per row of x). Panels are contiguous, so each
// thread streams its share of the matrix in address order.
#pragma once

#include <cstdint>
#include <vector>

#include "cpu_vec.h"
#include "huge_page_allocator.h"

namespace pyengine::cpu {

// avx512_bf16 (vdpbf16ps) present at run time.
bool has_bf16_gemm();

class PackedBf16Weight {
 public:
  // w: [K, N] row-major bf16 ("in, out"), K even.
  PackedBf16Weight(const bf16* w, int64_t k, int64_t n);

  int64_t k() const { return k_; }
  int64_t n() const { return n_; }

  // y [M, N] (row stride N) = x [M, K] (row stride x_row_stride) @ W + bias (bias [N] or null).
  void matmul(const bf16* x, int64_t x_row_stride, int64_t m, const bf16* bias, bf16* y) const;

 private:
  int64_t k_, n_, k_pairs_, panels_;
  std::vector<uint32_t, HugePageAllocator<uint32_t>> packed_;  // [panels][k_pairs][16] bf16 pairs
};

}  // namespace pyengine::cpu
