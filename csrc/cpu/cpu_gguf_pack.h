// Packing a GGUF tensor's Q4_0 / Q4_1 / Q8_0 blocks straight into the GEMM's compact panels, and
// reading packed columns back (a tied embedding's rows).
//
// pack_affine (cpu_gemm_affine.h) takes fp32 weights and searches each 32-input run for a scale s,
// offset m and codes q with fma(s, q, m) == w; for a GGUF model's dequantised weights that search
// was most of the load (~1.5 s for SmolLM2-135M on 2 cores). The file holds those very s, m and q:
//   Q8_0: w = d * q             -> s = d, m = 0       (q int8: the kAffine8 panels)
//   Q4_0: w = d * (q - 8)       -> s = d, m = -8 d    (q 0..15: kAffine4)
//   Q4_1: w = (d * q) + m_file  -> s = d, m = m_file  (q 0..15: kAffine4)
// with d and m_file fp16. d * q is exact in fp32 (11 significant bits times at most 8), so the
// kernels' fma(s, q, m), one rounding, equals GGUF's dequantisation, rounded once at the add: the
// packed weights are the dequantised ones bit for bit, and nothing is searched or made in fp32.
// A block whose d or m is not finite is refused (the caller dequantises; pack_affine then keeps
// the matrix dense, as before).
//
// Blocks as ggml lays them out: Q4_0 {fp16 d; uint8 qs[16]}, Q4_1 {fp16 d, m; uint8 qs[16]}
// (byte j: input j in the low nibble, j + 16 in the high one), Q8_0 {fp16 d; int8 qs[32]}.
#pragma once

#include <cstdint>

#include "cpu_gemm_affine.h"

namespace pyengine::cpu {

// ggml's type ids of the blocks packed from their codes.
enum class GgufBlockType : int32_t { kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8 };

// The panel format a ggml type packs into; kDense for every other type.
PanelFormat gguf_panel_format(int32_t ggml_type);

// A [K, N] weight as N rows of K / 32 GGUF blocks: rows[j] is output column j's first block
// (rows may be anywhere: a fused or reordered matrix is a list of row addresses, no copy).
struct GgufRows {
  int32_t ggml_type = 0;
  const uint8_t* const* rows = nullptr;
};

// Packs `src` into `out` in gguf_panel_format(src.ggml_type), threads of the CPU pool splitting the
// panels, laid out as AffineLayout(format, k, n, pair). False (out unspecified) for another
// type, K not a multiple of 32, or a non-finite d / m.
bool pack_gguf_rows(const GgufRows& src, int64_t k, int64_t n, PanelStore& out, bool pair = false);

// Columns ids[0 .. count) of a [K, N] weight packed in `format` (kAffine4 or kAffine8: the panels of
// PackedWeight, cpu_gemm_affine.h) as rows out[count][K] fp32: a tied lm_head's packed copy read
// back as token embeddings, so no second copy of its codes is kept. kAffine8 values are s * q, as
// GGUF dequantises Q8_0 (d * q, -0 included; both packers store m = +0 there); kAffine4 ones are
// the GEMM's fma(s, q, m). pair: as packed. False (out unspecified) for a dense format or an id
// outside [0, N).
bool packed_columns(const uint32_t* panels, PanelFormat format, int64_t k, int64_t n, const int64_t* ids,
                    int64_t count, float* out, bool pair = false);

}  // namespace pyengine::cpu
