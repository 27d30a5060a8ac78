// All the decoder layers of a Llama-family model, one CPU step in one call.
//
// Why: called op by op from Python, a SmolLM2 layer costs ~9 Python -> C++ crossings, their
// argument checks and torch allocations: ~2 ms of a decode step's 7 ms at batch 1 on 2 cores.
// Here the layer is the same sequence of the same C++ ops (cpu_ops.h, cpu_gemm.h) on the same
// buffers' values, so the hidden states equal the op-by-op path's bit for bit
// (pyengine/models/llama.py's LlamaDecoderLayer.forward is the specification; tests compare).
//
// Per layer, h the incoming hidden states and residual the stream before them:
//   layer 0: residual = h, x = rms_norm(h); else residual += h, x = rms_norm(residual)
//   qkv = x @ Wqkv; RoPE on q, k and the K/V cache write (rope_and_cache)
//   a = paged_attention(q); o = a @ Wo; residual += o, o = rms_norm(residual)
//   h = (silu(o @ Wgate) * (o @ Wup)) @ Wdown
// The caller applies the final norm (residual += h, norm(residual)), or the stack does (final_norm).
// Llama without qkv bias or q/k norms; the caller keeps other layers on the op-by-op path.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "cpu_gemm.h"
#include "cpu_ops.h"

namespace pyengine::cpu {

struct LlamaLayerWeights {
  const PackedWeight* qkv = nullptr;      // [hidden, (Hq + 2 Hkv) D]
  const PackedWeight* o = nullptr;        // [Hq D, hidden]
  const PackedWeight* gate_up = nullptr;  // [hidden, 2 I]
  const PackedWeight* down = nullptr;     // [I, hidden]
  const void* input_norm = nullptr;       // [hidden]
  const void* post_norm = nullptr;        // [hidden]
};

// One step's inputs, shared by every layer (as paged_attention / rope_and_cache take them).
struct LlamaStepParams {
  void* h = nullptr;         // [T, hidden] in: the embeddings; out: the last layer's MLP output
  void* residual = nullptr;  // [T, hidden] out: the residual stream before the final norm
  int32_t num_tokens = 0;
  const void* cos = nullptr;  // [T, D] (sin's first half holds -sin), see RopeAndCacheParams
  const void* sin = nullptr;
  const int64_t* positions = nullptr;  // or null; else cos / sin are [num_positions, D] tables
  int64_t num_positions = 0;
  // Or null: the final norm's weight [hidden]; then after the last layer residual += h and
  // h = rms_norm(residual) (the caller's fused_add_rms_norm, the same C++ op) - one Python op fewer.
  const void* final_norm = nullptr;
  const int64_t* slot_mapping = nullptr;  // [T]
  const int32_t* block_tables = nullptr;  // [R, block_table_stride]
  int64_t block_table_stride = 0;
  const int32_t* query_start_loc = nullptr;  // [R + 1]
  const int32_t* context_lens = nullptr;     // [R]
  int32_t num_rows = 0;
  std::vector<void*> k_caches, v_caches;  // per layer: [num_blocks, block_size, Hkv, D]
  int32_t block_size = 0;
  int64_t num_blocks = 0;
  bool use_pool = false;  // attention rows over the pool (torch at one thread: see cpu_ops.h)
  bool attention_avx2 = false;  // PagedAttentionParams.avx2_kernel
  // Or empty: the residual stream at the input of layer aux_layers[j] (0: the embeddings; the
  // number of layers: the stream before the final norm, kept only with final_norm) lands in
  // aux [T, aux_row_stride] at columns j * hidden.. (EAGLE-3's states: the layer loop's h + residual).
  std::vector<int32_t> aux_layers;
  void* aux = nullptr;
  int64_t aux_row_stride = 0;
};

class LlamaStack {
 public:
  // Checks every layer's weights against the shapes; ValueError (PE_CHECK) on a mismatch. The
  // PackedWeights and norm weights must outlive this object (the Python model owns them).
  LlamaStack(std::vector<LlamaLayerWeights> layers, int32_t hidden, int32_t num_heads, int32_t num_kv_heads,
             int32_t head_dim, int32_t intermediate, float eps, float scale, DType dtype);

  int32_t num_layers() const { return static_cast<int32_t>(layers_.size()); }

  // Runs every layer; returns an error message (empty on success) like the ops of cpu_ops.h.
  std::string forward(const LlamaStepParams& p) const;

 private:
  std::vector<LlamaLayerWeights> layers_;
  int32_t hidden_, num_heads_, num_kv_heads_, head_dim_, intermediate_;
  float eps_, scale_;
  DType dtype_;
};

}  // namespace pyengine::cpu
