// Paged attention over a block-table KV cache, any query length per row in one launch
// (plain C++ interface; the GQA kernels live in paged_attention.hip (CUDA cores: AMD) and
// paged_attention_mma.hip (tensor cores: NVIDIA), the split-KV combine in paged_attention.hip, the MLA
// kernels in mla_attention.hip, launched through mla_attention.h with the same parameter struct).
//
// Semantics (the PyTorch references in pyengine/ops/reference/attention.py and mla.py are the spec):
// row r owns query tokens [query_start_loc[r], query_start_loc[r+1]) (q_len of them), the last q_len
// positions of a context of context_lens[r] keys. Query i of the row attends to keys
// [0, context_lens[r] - (q_len - 1 - i)), key j of the row living at cache slot
// block_tables[r][j / block_size] * block_size + j % block_size.
//   out[t, h] = softmax_j(scale * q[t, h] . K[j, h / G]) @ V[j, h / G],   G = Hq / Hkv
//   lse[t, h] = natural-log log-sum-exp of the scaled scores; a query with no keys: out 0, lse +inf.
// GQA: K/V caches [num_blocks, block_size, Hkv, D], D in {64, 128, 256}.
// MLA: one latent head, cache [num_blocks, block_size, 576] = [c_kv (512) | k_pe (64)], D_qk = 576,
//      V = the first 512 values of each K row, out [T, Hq, 512].
// fp16/bf16 inputs, fp32 accumulation.
//
// Split-KV (flash-decoding) with a split size that depends only on the row itself, so that a row's
// result never depends on the rest of the batch: rows with q_len <= kSplitMaxQueryLen split their
// keys into chunks of split_size = split_block * ceil(ceil(ctx / split_block) / kMaxSplits) keys
// (at most kMaxSplits chunks); partial results go to a workspace and a combine kernel merges them.
// split_block is a per-process setting (default kPagedAttnSplitBlock), never a per-batch one.
// Other rows (prefill chunks) use one split and write the output directly.
// Batch-invariant rule (fixed_splits, GQA only): a query's keys [0, lim) are summed as ranges
// [0, U), [U, 2U), ... (U = split_block), each from a fresh online-softmax state, and the ranges'
// partials are merged in range order by one sequential merge (attention_common.h merge_range):
// rows of at most kSplitMaxQueryLen queries put each range in the workspace (ceil(ctx / U) splits,
// max_splits = ceil(max_ctx / U), no kMaxSplits cap) and the combine merges them; longer rows walk
// their ranges inside the block. A query's bits then depend only on its own keys, never on q_len,
// the row's context, the chunk it lands in or the batch.
#pragma once

#include <cstdint>

constexpr int kPagedAttnSplitBlock = 512;
constexpr int kPagedAttnMaxSplits = 16;
constexpr int kPagedAttnSplitMaxQueryLen = 16;

struct PagedAttentionParams {
  const void* q = nullptr;  // [T, Hq, D_qk], last dim contiguous
  int64_t q_stride_token = 0, q_stride_head = 0;  // elements
  const void* k_cache = nullptr;  // GQA [blocks, block_size, Hkv, D_qk]; MLA [blocks, block_size, 576]
  const void* v_cache = nullptr;  // GQA [blocks, block_size, Hkv, D_v]; MLA: ignored (V lives in K)
  void* out = nullptr;            // [T, Hq, D_v], last dim contiguous
  int64_t out_stride_token = 0, out_stride_head = 0;  // elements
  float* lse = nullptr;           // [T, Hq] fp32, optional
  // Workspace for split rows: ws_out [ws_tokens, Hq, max_splits, D_v], ws_lse [ws_tokens, Hq, max_splits]
  float* ws_out = nullptr;
  float* ws_lse = nullptr;
  const int32_t* ws_start = nullptr;        // [rows]: a split row's first token index in the workspace
  const int32_t* block_tables = nullptr;    // [rows, max_blocks_per_row]
  const int32_t* query_start_loc = nullptr; // [rows + 1]
  const int32_t* context_lens = nullptr;    // [rows]
  int num_rows = 0;
  int num_q_heads = 0;
  int num_kv_heads = 0;  // 1 for MLA
  int head_dim_qk = 0;
  int head_dim_v = 0;
  int block_size = 0;
  int max_blocks_per_row = 0;
  int max_query_len = 0;  // upper bound over rows
  // Upper bound of the launch's query tokens (query_start_loc[num_rows]; the q tensor's rows), 0:
  // unknown. The GQA launchers then number the rows' query tiles one after another along the grid
  // (flat_tiles) where that takes fewer blocks than rows x tiles of max_query_len: a step of a few
  // long rows and many short ones (a prompt beside decode rows, a prefill graph's padding rows).
  int max_num_tokens = 0;
  bool flat_tiles = false;  // set by the GQA launchers (attention_common.h block_tile)
  int max_splits = 1;     // workspace split dimension: min(kMaxSplits, ceil(max_ctx / split_block)), >= 1
  int split_block = kPagedAttnSplitBlock;  // keys per split unit, a multiple of 64
  bool fixed_splits = false;  // GQA: the batch-invariant split rule above (KernelConfig.batch_invariant)
  float scale = 1.0f;
  int dtype = 0;          // PeDType: 0 fp16, 1 bf16
  // GQA on CUDA: programmatic dependent launch. The kernel's blocks start while the previous kernel
  // (rope_and_cache, which allows it at its start) finishes, and the next one (the output
  // projection, itself launched so) may start streaming its weights once the key loops are done.
  bool pdl = false;
  int num_sms = 0;  // multiprocessors of the device (GQA: sizes the pairs per block); 0: unknown
  // Kernel choices (pyengine.ops.kernel_config.KernelConfig), no effect on the semantics:
  bool gqa_fma = false;         // NVIDIA: the FMA GQA kernel instead of the tensor-core one
  int gqa_pairs_per_block = 0;  // FMA GQA kernel: query-head pairs per block (1, 2, 4, 8); 0: chosen per launch
  bool mla_small_tile = false;  // NVIDIA: the small MLA tile (the one hipcc builds) instead of the fast one
  // MLA fixed key ranges (mla_attention.h): mla_walk makes every row walk its ranges in one block
  // (chosen per step from the batch; the same bits as one block per range). Walking blocks keep the
  // merged values in a slab of the fp32 accumulator pool (mla_acc_floats floats) taken under
  // mla_locks (mla_lock_count ints, all 0 between launches).
  bool mla_walk = false;
  float* mla_acc = nullptr;
  int64_t mla_acc_floats = 0;
  int* mla_locks = nullptr;
  int mla_lock_count = 0;
};

// GQA. Returns 0 on success, -1 for an unsupported configuration, else the runtime's error code.
int launch_paged_attention(const PagedAttentionParams& p, void* stream);

// GQA on NVIDIA tensor cores (paged_attention_mma.hip; not built by hipcc), without the combine:
// launch_paged_attention calls it unless p.gqa_fma asks for the FMA kernel.
int launch_paged_attention_mma(const PagedAttentionParams& p, void* stream);

// Merges the workspace partials of the split rows into out/lse (a no-op when max_splits == 1).
// The attention launchers call it; exposed for the MLA launcher, whose workspace has the same layout.
int launch_paged_attention_combine(const PagedAttentionParams& p, void* stream);
