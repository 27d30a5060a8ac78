// CPU versions of the model's hot per-layer ops (paged attention, RoPE + KV write, norms,
// SwiGLU's activation), for fp32 and bf16 tensors. Semantics are those of the PyTorch references
// (pyengine/ops/reference/attention.py, pyengine/ops/reference/layer.py): fp32 math, one rounding on store,
// each token computed the same way whatever else is in the batch.
//
// Python validates shapes (pyengine/ops) and passes raw data pointers (pyengine/ops/cpu): like the GPU
// kernels, this code never sees torch. Row strides are in elements.
//
// Misuse is reported by value: each entry point returns an error message (empty on success) that
// pyengine/ops/cpu raises as ValueError; the pool's worker threads must never throw.
#pragma once

#include <cstdint>
#include <string>

namespace pyengine::cpu {

enum class DType : int32_t { kFloat32 = 0, kBFloat16 = 1 };

struct PagedAttentionParams {
  const void* q = nullptr;  // [T, Hq, D], head rows contiguous, token rows q_row_stride apart
  int64_t q_row_stride = 0;
  const void* k_cache = nullptr;  // [num_blocks, block_size, Hkv, D]
  const void* v_cache = nullptr;
  void* out = nullptr;    // [T, Hq, D] contiguous
  float* lse = nullptr;   // [T, Hq] natural-log logsumexp, or null
  const int32_t* block_tables = nullptr;  // [R, block_table_stride]
  int64_t block_table_stride = 0;
  const int32_t* query_start_loc = nullptr;  // [R + 1]
  const int32_t* context_lens = nullptr;     // [R], keys after this step
  int32_t num_rows = 0, num_heads = 0, num_kv_heads = 0, head_dim = 0, block_size = 0;
  int64_t num_blocks = 0;  // of the caches: block ids read must lie in [0, num_blocks)
  float scale = 1.0f;
  DType dtype = DType::kFloat32;  // of q, out and the caches
  bool use_pool = false;          // split rows over the shared pool (cpu_thread_pool.h)
  bool avx2_kernel = false;       // the AVX2 + FMA kernel even where AVX-512 is present (tests)
};

// Causal varlen attention: query i of a row of q_len tokens sees keys [0, ctx - (q_len - 1 - i)).
std::string paged_attention(const PagedAttentionParams& p);

struct RopeAndCacheParams {
  void* qk = nullptr;  // [T, Hq + Hkv, D], heads contiguous, token rows qk_row_stride apart
  int64_t qk_row_stride = 0;
  const void* v = nullptr;  // [T, Hkv, D], token rows v_row_stride apart
  int64_t v_row_stride = 0;
  const void* cos = nullptr;  // [T, D] or null (no rotation); sin's first half holds -sin
  const void* sin = nullptr;
  // Or null: cos / sin are tables [num_positions, D] and token t takes row positions[t] (the
  // rotary embedding's index_select, done here: one Python op fewer per step).
  const int64_t* positions = nullptr;
  int64_t num_positions = 0;
  void* k_cache = nullptr;  // [num_blocks, block_size, Hkv, D]
  void* v_cache = nullptr;
  const int64_t* slot_mapping = nullptr;  // [T], < 0 = do not write
  int64_t num_slots = 0;                  // num_blocks * block_size of the caches
  int32_t num_tokens = 0, num_heads = 0, num_kv_heads = 0, head_dim = 0;
  DType dtype = DType::kFloat32;
  bool use_pool = false;  // tokens over the shared pool, as in PagedAttentionParams
};

std::string rope_and_cache(const RopeAndCacheParams& p);

struct RmsNormParams {
  void* x = nullptr;               // [T, H] contiguous; the output when out is null
  void* residual = nullptr;        // [T, H] or null; when set: residual += x, x = norm(residual)
  void* out = nullptr;             // [T, H] or null (plain rms_norm writes here)
  const void* weight = nullptr;    // [H]
  int32_t num_tokens = 0, hidden = 0;
  float eps = 1e-6f;
  DType dtype = DType::kFloat32;
};

std::string rms_norm(const RmsNormParams& p);

// out [T, I] = silu(x[:, :I]) * x[:, I:] for x [T, 2I] contiguous. use_pool: as in
// PagedAttentionParams (element-wise: the result does not depend on it).
void silu_and_mul(const void* x, void* out, int32_t num_tokens, int32_t inter, DType dtype, bool use_pool = false);

// Per row of x [rows, cols] fp32 (rows row_stride apart): tok[r] = NumPy's argmax (the first
// maximum; the first NaN where the row has one), finite[r] = no NaN or +-inf in the row.
void argmax_rows(const float* x, int64_t rows, int64_t cols, int64_t row_stride, int64_t* tok, bool* finite);

}  // namespace pyengine::cpu
