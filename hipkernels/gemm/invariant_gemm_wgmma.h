// The batch-invariant GEMM on Hopper's warpgroup tensor cores (invariant_gemm_wgmma.hip): the same
// contract as invariant_gemm.h (launched through launch_invariant_gemm, which picks this family
// wherever the build has it), another kernel family.
//
// Reduction order. y[m, n] is summed in an order fixed by (K, N, the device's multiprocessor count)
// alone: K is cut into the same `split` ranges as invariant_gemm_split gives; inside a range the k
// tiles of 64, and the four 16-deep wgmma products of each (m64n128k16, or n192 / n256 for the
// wide tiles), are accumulated in increasing order into fp32 registers that start from zero; the
// ranges' partial sums are then added in increasing order (inside a thread-block cluster for
// launches of few tiles, by one block walking the ranges in turn for many tiles: the same fp32
// operations), bias last, one rounding.
// Every row lands in one 64-row wgmma whatever M is (TMA zero-fills rows past M), so a row's bits
// are the same alone, in any batch, at any position; on the H100 they also equal the mma.sync
// kernel's for the same ranges (measured; see invariant_gemm_wgmma_default_for).
//
// Which family runs depends on the build (sm_90a CUDA with the driver's tensor-map encoder), the
// weight (under 2^23 elements only above 256 rows: below that a launch's fixed cost, 5-13 us on an
// H100 against mma.sync's 3-5 us at SmolLM2's widths, would dominate), M and the K ranges' length
// (invariant_gemm_wgmma_default_for).
#pragma once

#include "gemm/invariant_gemm.h"

// Whether this build and driver run the wgmma family (false under hipcc).
bool invariant_gemm_wgmma_available();

// Whether launch_invariant_gemm's default (family 0) takes the wgmma family: weights of at least
// 2^23 elements from kWgmmaMinRows rows on, and from kWgmmaChainRows rows where a K range is long
// (split 1, or at least kWgmmaChainTiles k tiles): there the wgmma family streams the weights
// faster than the mma.sync kernel's 64-row tiles, while for short ranges its cluster combine
// costs more; up to 16 rows mma.sync's 16-row tiles are faster (H100:
// docs/kernels/invariant_gemm.md). Choosing by M keeps a row's bits because the two families give
// the same bits for the same K ranges: both sum each 16-wide k step on the same tensor cores and
// add the steps, ranges and bias in one order. That equality is measured, not documented by
// NVIDIA: tests/test_invariant_gemm_gpu.py::test_the_families_give_the_same_bits checks it on the
// device.
// Smaller weights take wgmma above 256 rows (prefill chunks), where the mma.sync family's 128 x 128
// walking tile is 1.5-3x slower (H100, SmolLM2's down at 4096 rows 17.7 us against 53.9), except
// narrow ones under kInvariantGemmNarrowColumns wide (SmolLM2's qkv / o / down), whose small
// mma.sync tiles win up to kInvariantGemmNarrowRows (H100, down at 320 rows 8.5 us against 15.5,
// o 4.0 against 6.1; wgmma ties or wins from 768 rows and for gate_up: docs/kernels/invariant_gemm.md).
constexpr int kWgmmaMinRows = 65, kWgmmaChainRows = 17, kWgmmaChainTiles = 32, kWgmmaSmallWeightRows = 257;
inline bool invariant_gemm_wgmma_default_for(int m, int k, int n, int splits, int num_sms) {
  if ((int64_t)k * n < (int64_t{1} << 23))
    return n < kInvariantGemmNarrowColumns && invariant_gemm_narrow(n, splits, num_sms) ? m > kInvariantGemmNarrowRows
                                                                                        : m >= kWgmmaSmallWeightRows;
  if (m < kWgmmaChainRows) return false;
  return m >= kWgmmaMinRows || splits == 1 || k / 64 / splits >= kWgmmaChainTiles;
}

// Launch with the K split already chosen (1, 2, 4 or 8); the caller has checked the shape and M > 0.
int launch_invariant_gemm_wgmma(const InvariantGemmParams& p, int splits, void* stream);

// The 128 x 256 and 128 x 192 tiles (invariant_gemm_wgmma_wide.hip), 16-byte aligned output rows:
// 256 for one K range (its 128 accumulator registers a thread leave no room for a running total);
// 192 for one range or a block walking the ranges. wide_for gives the width launch_invariant_gemm_wgmma
// takes above 64 rows, or 0: 256 at split 1 (Llama-8B's gate_up and lm_head; for weights under
// 2^23 elements the width of fewest waves x width, 0 meaning 128), 192 at split > 1 unless its
// blocks are too few for the K chain (k tiles > 6 x blocks: Llama-8B's down at 65-128 rows).
// H100 figures: docs/kernels/invariant_gemm.md. The same bits as the other tiles.
int invariant_gemm_wgmma_wide_for(const InvariantGemmParams& p, int splits);
int launch_invariant_gemm_wgmma_wide(const InvariantGemmParams& p, int splits, int width, void* stream);
