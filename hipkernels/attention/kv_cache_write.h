// Paged KV-cache write of MLA (plain C++ interface; the kernel lives in kv_cache_write.hip). The GQA
// K/V caches are written by rope_and_cache (layer_ops/layer_ops.h).
//
// reshape_and_cache_mla: the latent cache holds one row of width A + B per slot,
// [c_kv (A = 512) | k_pe (B = 64)], in a cache [num_blocks, block_size, A + B] (contiguous), at the
// flat slot slot_mapping[t] = block_id * block_size + offset (int64); a slot of -1 writes nothing.
// The cache has the dtype of the inputs (fp16, bf16 or fp32): a pure copy, 16 bytes per access when
// the rows are 16-byte aligned.
#pragma once

#include <cstdint>

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

// Returns 0 on success or the runtime's error code (see pe_error_string in common/runtime.h).
int launch_reshape_and_cache_mla(const ReshapeAndCacheMlaParams& p, void* stream);
