// Paged KV-cache writes (plain C++ interface; the kernels live in kv_cache_write.hip).
//
// reshape_and_cache: key/value [T, H, D] (rows may be strided, the last dim contiguous) are copied
// into k_cache/v_cache [num_blocks, block_size, H, D] (contiguous) at the flat slot
// slot_mapping[t] = block_id * block_size + offset (int64); a slot of -1 writes nothing.
// The cache has the dtype of key/value (fp16, bf16 or fp32): a pure copy, 16 bytes per access when
// the rows are 16-byte aligned.
//
// reshape_and_cache_mla: the MLA latent cache holds one row of width A + B per slot,
// [c_kv (A = 512) | k_pe (B = 64)], in a cache [num_blocks, block_size, A + B].
#pragma once

#include <cstdint>

struct ReshapeAndCacheParams {
  const void* key = nullptr;    // [T, H, D]
  const void* value = nullptr;  // [T, H, D]
  void* k_cache = nullptr;      // [num_blocks, block_size, H, D]
  void* v_cache = nullptr;      // [num_blocks, block_size, H, D]
  const int64_t* slot_mapping = nullptr;  // [T]
  int64_t num_tokens = 0;
  int num_heads = 0;
  int head_size = 0;
  int64_t key_stride_token = 0, key_stride_head = 0;  // in elements
  int64_t value_stride_token = 0, value_stride_head = 0;
  int elem_size = 2;  // bytes: 2 (fp16/bf16) or 4 (fp32)
};

struct ReshapeAndCacheMlaParams {
  const void* c_kv = nullptr;  // [T, A]
  const void* k_pe = nullptr;  // [T, B]
  void* kv_cache = nullptr;    // [num_blocks, block_size, A + B]
  const int64_t* slot_mapping = nullptr;  // [T]
  int64_t num_tokens = 0;
  int kv_lora_rank = 512;  // A
  int rope_dim = 64;       // B
  int64_t c_kv_stride_token = 0, k_pe_stride_token = 0;  // in elements
  int elem_size = 2;
};

// Both return 0 on success or the runtime's error code (see pe_error_string in runtime.h).
int launch_reshape_and_cache(const ReshapeAndCacheParams& p, void* stream);
int launch_reshape_and_cache_mla(const ReshapeAndCacheMlaParams& p, void* stream);
