// The online softmax of one 64-key tile in the fast MLA tiles' S accumulator (wgmma layout: lane
// 4 g + q holds s[4 nt + 2 j + e] = S[row j][8 nt + 2 q + e], row j = 16 warp + g + 8 j; a row's 64
// keys sit in one quad of lanes). These kernels issue few warps per SM (8), so the softmax's
// instruction count is on the critical path between a tile's S and its P V: a tile wholly inside
// both rows' keys skips the mask, the scale folds into the exponent's FMA, and exp2 is the hardware
// approximation (one MUFU.EX2) rather than exp2f's range-checked sequence. Every assignment and
// step shape runs this same code, so a query's bits still do not depend on the batch.
#pragma once

#include "common/hip_compat.h"
#include "attention/attention_common.h"

namespace pe_mla {

using pe_attn::neg_inf;

PE_DEVICE float fast_exp2(float x) {
#if defined(PE_CUDA) && defined(__CUDA_ARCH__)
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));  // -inf -> +0
  return y;
#else
  return exp2f(x);
#endif
}

// The reference maximum moves only when a tile's maximum passes it by more than kRescaleSlack (in
// log2 units), so that O is rarely rescaled (256 multiplies a thread): P stays <= 2^kRescaleSlack,
// which bf16 P and fp32 sums hold with the same relative precision, and O / L is unchanged.
constexpr float kRescaleSlack = 8.f;

// s: raw Q K^T of tile keys tile_key0 .. + 63 on entry, P = 2^(s scale - m) on exit (0 past lim[j]);
// mx / ls: the rows' reference maxima (of s * scale, within kRescaleSlack of the true maxima) and
// sums; alpha: the factor O must be rescaled by (1 when the reference did not move).
PE_DEVICE void online_softmax_tile(float (&s)[32], int tile_key0, int q, const int (&lim)[2], float scale,
                                   float (&mx)[2], float (&ls)[2], float (&alpha)[2]) {
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    float hmax = neg_inf();
    if (tile_key0 + 64 <= lim[j]) {
#pragma unroll
      for (int k = 0; k < 16; ++k) hmax = fmaxf(hmax, s[4 * (k >> 1) + 2 * j + (k & 1)]);
    } else {
#pragma unroll
      for (int k = 0; k < 16; ++k) {
        float& v = s[4 * (k >> 1) + 2 * j + (k & 1)];
        if (tile_key0 + 8 * (k >> 1) + 2 * q + (k & 1) >= lim[j]) v = neg_inf();
        hmax = fmaxf(hmax, v);
      }
    }
    hmax = fmaxf(hmax, pe_shfl_xor(hmax, 1));
    hmax = fmaxf(hmax, pe_shfl_xor(hmax, 2));
    const float mn = hmax * scale;
    alpha[j] = 1.f;
    if (mn > mx[j] + kRescaleSlack) {  // true for the first key of a row (mx = -inf)
      alpha[j] = fast_exp2(mx[j] - mn);  // 0 when the old max was -inf (O and ls are 0 then)
      ls[j] *= alpha[j];
      mx[j] = mn;
    }
    const float ref = mx[j] == neg_inf() ? 0.f : mx[j];  // a row with no key yet: all P are 0
#pragma unroll
    for (int k = 0; k < 16; ++k) {
      float& v = s[4 * (k >> 1) + 2 * j + (k & 1)];
      v = fast_exp2(fmaf(v, scale, -ref));
      ls[j] += v;
    }
  }
}

}  // namespace pe_mla
