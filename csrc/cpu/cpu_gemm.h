// GEMM for CPU decode, bf16 or fp32: y[M, N] = x[M, K] @ W[K, N] (+ bias), weights packed once.
//
// Why not oneDNN: at decode sizes (M of 1 to a few dozen rows) the step streams every weight once,
// and oneDNN's bf16 kernels reached ~21-24 GB/s of the machine's ~30-45 (SmolLM2, 2 cores); its
// kernel choice also depends on M, so a row's result could change with the batch around it (on an
// AVX2 EPYC, SmolLM2's logits of one request moved by up to 8e-5 in fp32 and 0.63 in bf16 next to
// a 400-token prompt). Here a row's output is the same k-ordered sum for any M and any thread count
// (rows are independent and the packing fixes the order), which keeps greedy speculation identical
// to plain decoding.
//
// Kernels: AVX-512 (+ avx512_bf16 for bf16) where the CPU has them, else AVX2 + FMA
// (cpu_gemm_avx2.h), for every format below; the two families give different last bits, each
// batch-invariant. Without AVX2 + FMA (or off x86-64 GCC/Clang) has_gemm() is false and Python
// keeps oneDNN or dense weights.
//
// Layout: 16-column panels of 64-byte lines: per k (fp32) or per pair of k (bf16: the columns'
// (w[2k], w[2k+1]) pairs of vdpbf16ps), one line feeds one FMA per row of x (AVX2: two ymm halves;
// bf16 pairs widened to two fp32 k). Panels are contiguous, so each thread streams its share of
// the matrix in address order. fp32 weights that hold block-quantised values (GGUF Q4_0/Q4_1/Q8_0)
// are packed smaller, losslessly: see cpu_gemm_affine.h.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "cpu_gemm_affine.h"
#include "cpu_gemm_qdot.h"
#include "cpu_gguf_pack.h"
#include "cpu_ops.h"
#include "cpu_vec.h"

namespace pyengine::cpu {

// Which kernels run `dtype` here: AVX-512 (for bf16 also avx512_bf16), else AVX2 + FMA
// (cpu_gemm_avx2.h: dense fp32, bf16 pairs and the affine formats), else none.
// kAmx: the int16-limb GGUF panels on AMX-INT8 from 4 rows, AVX-512 VNNI below (cpu_gemm_qdot.h).
enum class GemmIsa : int32_t { kNone = 0, kAvx2 = 2, kAvx512 = 3, kAmx = 4 };
GemmIsa gemm_isa(DType dtype);
// Whether some kernel runs `dtype` on this CPU (gemm_isa(dtype) != kNone).
bool has_gemm(DType dtype);

class PackedWeight {
 public:
  // Why a weight of this shape and dtype cannot be packed here (empty: it can).
  static std::string check(int64_t k, int64_t n, DType dtype);
  // w: [K, N] row-major ("in, out") of `dtype`; check() must have passed. compact: fp32 weights
  // that fit cpu_gemm_affine.h's formats are stored that way (same results, fewer bytes).
  // isa_limit kAvx2: the AVX2 + FMA kernels even where AVX-512 is present (other bits; tests).
  PackedWeight(const void* w, int64_t k, int64_t n, DType dtype, bool compact = true,
               GemmIsa isa_limit = GemmIsa::kAmx);
  // An fp32 weight [K, N] packed straight from GGUF blocks. Where the CPU has AVX2 + F16C, as
  // the integer-dot panels of cpu_gemm_qdot.h (llama.cpp's arithmetic: int8 activations, not the
  // fp32 products of the dequantised weights); else, or where those refuse a block, as the
  // weights the fp32 constructor packs from their dequantised values (cpu_gguf_pack.h), without
  // making them. nullopt where both refuse, or check(k, n, fp32) fails.
  // act_bits 8: llama.cpp's arithmetic (cpu_gemm_qdot.h) where the CPU has it; 32: the same
  // panels with activations as two int16 limbs (cpu_gemm_qdot.h); else, and 0, the dequantised
  // weights' fp32 products, rebuilt exactly (cpu_gemm_affine.h). act_bits 32 runs the best kernels
  // of cpu_gemm_qdot.h's qdot16_isa(isa_limit) (isa() says which; the same bits on each); the exact
  // path takes the limit as the constructor does.
  static std::optional<PackedWeight> from_gguf(const GgufRows& rows, int64_t k, int64_t n, int act_bits,
                                               GemmIsa isa_limit = GemmIsa::kAmx);

  int64_t k() const { return k_; }
  int64_t n() const { return n_; }
  PanelFormat format() const { return format_; }
  GemmIsa isa() const { return isa_; }
  int64_t packed_bytes() const { return static_cast<int64_t>(packed_.size() * sizeof(uint32_t)); }
  const uint32_t* panels() const { return packed_.data(); }  // the layout format() and paired() say
  // Affine panels in pairs (AffineLayout): the AVX2 kernels' layout.
  bool paired() const { return isa_ == GemmIsa::kAvx2 && format_ != PanelFormat::kDense && qdot_act_bits_ == 0; }
  // The integer-dot panels of cpu_gemm_qdot.h (format() says 4 or 8 bits), from GGUF codes, run
  // with int8 activations (llama.cpp's arithmetic).
  bool int8_dot() const { return qdot_act_bits_ == 8; }
  // The bits of the activations those panels run with: 8 or 32 (two int16 limbs); 0: not such panels.
  int qdot_act_bits() const { return qdot_act_bits_; }

  // y [M, N] (row stride N) = x [M, K] (row stride x_row_stride) @ W + bias (bias [N] or null).
  // All of `dtype`.
  void matmul(const void* x, int64_t x_row_stride, int64_t m, const void* bias, void* y) const;
  // Columns ids[0 .. count) as rows out[count][K] fp32 (cpu_gguf_pack.h packed_columns, or
  // cpu_gemm_qdot.h qdot_columns). False for a dense format or an id outside [0, N).
  bool columns(const int64_t* ids, int64_t count, float* out) const;

 private:
  int64_t k_, n_, k_steps_, panels_;
  DType dtype_;
  GemmIsa isa_;
  PanelFormat format_ = PanelFormat::kDense;
  int qdot_act_bits_ = 0;
  PanelStore packed_;  // dense: [panels][k_steps][16] fp32 or bf16 pairs; else cpu_gemm_affine.h
};

}  // namespace pyengine::cpu
