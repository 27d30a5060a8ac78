// Compact panels for fp32 weights that hold block-quantised values, read back bit for bit.
//
// A GGUF model's Q4_0, Q4_1 and Q8_0 tensors, dequantised to fp32 on load (the engine's weights),
// hold in each run of 32 consecutive inputs of one output column w = fl(s * q + m): one fp32
// scale s and offset m per run, and small integers q (0..15, or -128..127 with m = 0). Storing
// q and (s, m) instead of w, and rebuilding each weight in the kernel with that same fused
// multiply-add, gives the very same fp32 weights at 0.75 (4-bit) or 1.25 (8-bit) bytes each
// instead of 4: a decode step's linears stream 5x fewer bytes, and the GEMM's results are those of
// the dense fp32 panels bit for bit (same weights, same k-ordered sums).
//
// Nothing here trusts the file: (s, m, q) are found from the fp32 values and every weight is
// checked to come back exactly; a matrix with one run that does not fit stays dense.
//
// Kernels: AVX-512 ones here (affine_kernels: the weights rebuilt in zmm registers); on AVX2 + FMA
// CPUs cpu_gemm_avx2.cpp rebuilds each block (or, for many rows, the whole panel) into an fp32
// buffer with the same fma and runs its dense kernel over it.
//
// Layout: 16-column panels as in cpu_gemm.h; per panel, K / 32 blocks of
//   s[16] fp32, m[16] fp32, then q lines of 16 bytes (one byte per column):
//   4-bit: 16 lines, line j holds inputs 2j (low nibble) and 2j + 1 (high nibble);
//   8-bit: 32 lines of int8.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <vector>

#include "cpu_panel_store.h"

namespace pyengine::cpu {

enum class PanelFormat : int32_t { kDense = 0, kAffine4 = 4, kAffine8 = 8 };

constexpr int kAffineRun = 32;  // inputs per (s, m) pair: the block of GGUF's Q4_0/Q4_1/Q8_0

// uint32 words of one 32-input block of one panel: 32 (s, m) words + the q lines.
constexpr int64_t affine_block_words(PanelFormat f) { return 32 + (f == PanelFormat::kAffine4 ? 64 : 128); }

constexpr int kPanelCols = 16;  // columns per panel: one zmm of fp32 accumulators
constexpr int kGemmRows = 16;   // rows of x per micro-kernel call: 16 accumulators

// Where the blocks lie. Unpaired: panel after panel, each its K / 32 blocks in order. Paired
// (the AVX2 kernels' layout): panels 2i and 2i + 1 interleaved block by block - block b of
// 2i, block b of 2i + 1, block b + 1 of 2i, ... (a last odd panel alone, as unpaired) - so that a
// row run against both panels at once (cpu_gemm_avx2.cpp: twice the independent FMA chains)
// reads one sequential stream: two streams 7 KB apart were 20% slower than one (AMD EPYC, the
// hardware prefetcher). Same words, same size; only the order differs.
struct AffineLayout {
  int64_t panels = 0, blocks = 0, words = 0;  // words: uint32 per block
  bool paired = false;

  AffineLayout(PanelFormat f, int64_t k, int64_t n, bool pair);
  // Panels sharing panel p's stream (2 in a full pair, else 1).
  int64_t width(int64_t p) const { return paired ? std::min<int64_t>(2, panels - p / 2 * 2) : 1; }
  // uint32 offset of block b of panel p.
  int64_t block(int64_t p, int64_t b) const {
    if (!paired) return (p * blocks + b) * words;
    return (p / 2 * 2 * blocks + b * width(p) + p % 2) * words;
  }
  // uint32 words from one block of panel p to its next.
  int64_t step(int64_t p) const { return width(p) * words; }
};

// Packs w [K, N] (row-major fp32) into `out` in format f (kAffine4 or kAffine8), laid out as
// AffineLayout(f, k, n, pair) says. Returns false, leaving `out` unspecified, when K is not a
// multiple of 32 or some run does not fit exactly.
bool pack_affine(const float* w, int64_t k, int64_t n, PanelFormat f, PanelStore& out, bool pair = false);

// AVX-512 only: one panel times up to kGemmRows rows of x: (x, x_row_stride, panel, K, bias or null, y,
// y_row_stride, valid columns). kernels[r - 1] takes r rows; run by cpu_gemm.cpp's panel loop.
// The affine kernels for r rows read x interleaved, [K][r] (see interleave_rows; x_row_stride
// unused): every broadcast is one base register plus a constant, where 16 row pointers spilled
// registers (11% faster on 16 rows).
using F32MicroKernel = void (*)(const float*, int64_t, const uint32_t*, int64_t, const float*, float*, int64_t, int);
using F32MicroKernels = std::array<F32MicroKernel, kGemmRows>;
const F32MicroKernels& affine_kernels(PanelFormat f);

// x [M, K] (row stride x_row_stride) -> dst: tiles of 16 rows as [K][16], then the last M % 16
// rows as [K][M % 16] (tile i at dst + i * K * 16). K % 16 == 0.
void interleave_rows(const float* x, int64_t x_row_stride, int64_t m, int64_t k, float* dst);

}  // namespace pyengine::cpu
