// Batch-invariant GEMM (semantics and reduction order in invariant_gemm.h): one matrix. The wgmma
// family (invariant_gemm_wgmma.hip) where the build has it, else the mma.sync tile kernel over its
// row tiles in blockIdx.y. The tile kernel and its launch are invariant_gemm_kernel.h's, shared with
// the grouped GEMM (grouped_gemm.hip).
#include "gemm/invariant_gemm.h"

#include "gemm/invariant_gemm_kernel.h"
#include "gemm/invariant_gemm_wgmma.h"

using namespace pe_invariant_gemm;

int invariant_gemm_split(int k, int n, int num_sms) {
  // About one block per multiprocessor for a one-tile-high launch (decode), while every range
  // keeps at least kMinRangeTiles k tiles: at decode sizes a split's cluster combine costs as much
  // as 5-10 k tiles of a block's chain (H100, docs/kernels/invariant_gemm.md), so a short K
  // (SmolLM2's 576) is not split. A function of K, N and the device only.
  const int tiles = (n + kBN - 1) / kBN, k_tiles = k / kBK;
  int splits = 1;
  while (splits < kMaxSplit && 10 * tiles * splits < 9 * num_sms && k_tiles >= 2 * kMinRangeTiles * splits)
    splits *= 2;
  return splits;
}

int launch_invariant_gemm(const InvariantGemmParams& p, void* stream) {
  if (!takes_shape(p)) return -1;
  const int splits = p.split == 0 ? invariant_gemm_split(p.k, p.n, p.num_sms) : p.split;
  if (splits != 1 && splits != 2 && splits != 4 && splits != kMaxSplit) return -1;
  if (p.m == 0 || p.n == 0) return 0;
  if (p.family < 0 || p.family > 2) return -1;
  // The family from the build, (K, N) and M: the two give a row the same bits (invariant_gemm_wgmma.h).
  const bool wgmma = p.family == 2 || (p.family == 0 && invariant_gemm_wgmma_default_for(p.m, p.k, p.n, splits, p.num_sms));
  if (wgmma && invariant_gemm_wgmma_available()) return launch_invariant_gemm_wgmma(p, splits, stream);
  return launch_typed(p, DenseRows{}, p.m, splits, stream);
}
