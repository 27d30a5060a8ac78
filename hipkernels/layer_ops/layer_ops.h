// Per-token layer ops of the decoder (plain C++ interface; the kernels live in layer_ops.hip).
// Semantics are those of pyengine/ops/reference/layer.py: fp32 math, one rounding to the storage
// type on every store, and every token computed on its own (one token's result never depends on
// the number or the content of the other tokens in the launch).
//
//   rms_norm            out[t] = x[t] * rsqrt(mean(x[t]^2) + eps) * weight
//   fused_add_rms_norm  in place: residual[t] <- x[t] + residual[t] (rounded), then
//                       x[t] <- rms_norm(residual[t]) computed from the rounded residual
//   silu_and_mul        out[t, i] = silu(x[t, i]) * x[t, I + i], x [T, 2I] -> out [T, I]
//   rope_and_cache      in place: qk[t, h] <- qk[t, h] * cos[t] + rotate(qk[t, h]) * sin[t] for every
//                       q and k head (rotate swaps the halves of head_dim; cos = nullptr: no rotation),
//                       then k = qk[t, Hq:] and v[t] are copied into the paged caches
//                       [num_blocks, block_size, Hkv, D] at slot_mapping[t] (-1: no write)
//
// Storage types: fp16, bf16 or fp32 (PeDType), one type for all tensors of a call. Rows may be
// strided (the last dim contiguous); 16 bytes per access when every row start is 16-byte aligned,
// otherwise one element per access.
#pragma once

#include <cstdint>

struct RmsNormParams {
  const void* x = nullptr;  // [T, H], rows x_stride elements apart
  void* residual = nullptr;  // fused_add_rms_norm only: [T, H], rows residual_stride apart
  const void* weight = nullptr;  // [H]
  void* out = nullptr;  // [T, H], rows out_stride apart (fused_add_rms_norm: out aliases x)
  int64_t num_tokens = 0;
  int hidden = 0;
  int64_t x_stride = 0, residual_stride = 0, out_stride = 0;  // in elements
  float eps = 1e-6f;
  int dtype = 0;  // PeDType
};

struct SiluAndMulParams {
  const void* x = nullptr;  // [T, 2I], rows x_stride elements apart
  void* out = nullptr;      // [T, I], rows out_stride elements apart
  int64_t num_tokens = 0;
  int inter = 0;  // I
  int64_t x_stride = 0, out_stride = 0;
  int dtype = 0;
};

struct RopeAndCacheParams {
  void* qk = nullptr;        // [T, Hq + Hkv, D], rotated in place
  const void* v = nullptr;   // [T, Hkv, D]
  const void* cos = nullptr;  // [T, D], nullptr: no rotation (sin ignored)
  const void* sin = nullptr;  // [T, D], the sign of rotate_half folded into its first half
  void* k_cache = nullptr;   // [num_blocks, block_size, Hkv, D], contiguous
  void* v_cache = nullptr;
  const int64_t* slot_mapping = nullptr;  // [T], -1: rotate only, write no KV
  int64_t num_tokens = 0;
  int num_q_heads = 0, num_kv_heads = 0, head_dim = 0;
  int64_t qk_stride_token = 0, qk_stride_head = 0;  // in elements
  int64_t v_stride_token = 0, v_stride_head = 0;
  int64_t cos_stride_token = 0, sin_stride_token = 0;
  int dtype = 0;
};

// Each returns 0 on success, -1 for a configuration the kernels do not take (odd head_dim, a row
// too wide for one block's registers, an unknown dtype), or the runtime's error code.
int launch_rms_norm(const RmsNormParams& p, void* stream);
int launch_fused_add_rms_norm(const RmsNormParams& p, void* stream);
int launch_silu_and_mul(const SiluAndMulParams& p, void* stream);
int launch_rope_and_cache(const RopeAndCacheParams& p, void* stream);
