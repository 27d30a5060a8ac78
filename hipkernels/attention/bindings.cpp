// Python bindings of the attention kernels: PagedAttentionParams and ReshapeAndCacheMlaParams as
// classes (pointers as integers), launched with the current stream; pyengine/ops/cuda/ fills them.
#include "attention/kv_cache_write.h"
#include "attention/mla_attention.h"
#include "attention/paged_attention.h"
#include "common/binding_utils.h"
#include "common/register_kernels.h"

using namespace pyengine_bindings;  // ParamsClass, def_launch

void register_attention_kernels(py::module_& k) {
  using A = PagedAttentionParams;
  ParamsClass<A>(k, "PagedAttentionParams")
      .PE_FIELD(A, q).PE_FIELD(A, q_stride_token).PE_FIELD(A, q_stride_head)
      .PE_FIELD(A, k_cache).PE_FIELD(A, v_cache)
      .PE_FIELD(A, out).PE_FIELD(A, out_stride_token).PE_FIELD(A, out_stride_head).PE_FIELD(A, lse)
      .PE_FIELD(A, ws_out).PE_FIELD(A, ws_lse).PE_FIELD(A, ws_start)
      .PE_FIELD(A, block_tables).PE_FIELD(A, query_start_loc).PE_FIELD(A, context_lens)
      .PE_FIELD(A, num_rows).PE_FIELD(A, num_q_heads).PE_FIELD(A, num_kv_heads)
      .PE_FIELD(A, head_dim_qk).PE_FIELD(A, head_dim_v).PE_FIELD(A, block_size).PE_FIELD(A, max_blocks_per_row)
      .PE_FIELD(A, max_query_len).PE_FIELD(A, max_num_tokens).PE_FIELD(A, max_splits).PE_FIELD(A, split_block).PE_FIELD(A, fixed_splits)
      .PE_FIELD(A, scale)
      .PE_FIELD(A, dtype).PE_FIELD(A, pdl).PE_FIELD(A, num_sms)
      .PE_FIELD(A, gqa_fma).PE_FIELD(A, gqa_pairs_per_block).PE_FIELD(A, mla_small_tile)
      .PE_FIELD(A, mla_walk).PE_FIELD(A, mla_acc).PE_FIELD(A, mla_acc_floats).PE_FIELD(A, mla_locks)
      .PE_FIELD(A, mla_lock_count);
  def_launch(k, "paged_attention", &launch_paged_attention);
  def_launch(k, "paged_attention_mla", &launch_mla_attention);

  using M = ReshapeAndCacheMlaParams;
  ParamsClass<M>(k, "ReshapeAndCacheMlaParams")
      .PE_FIELD(M, c_kv).PE_FIELD(M, k_pe).PE_FIELD(M, kv_cache).PE_FIELD(M, slot_mapping)
      .PE_FIELD(M, num_tokens).PE_FIELD(M, kv_lora_rank).PE_FIELD(M, rope_dim)
      .PE_FIELD(M, c_kv_stride_token).PE_FIELD(M, k_pe_stride_token).PE_FIELD(M, elem_size);
  def_launch(k, "reshape_and_cache_mla", &launch_reshape_and_cache_mla);

  k.def("paged_attention_constants", []() {
    py::dict d;
    d["split_block"] = kPagedAttnSplitBlock;
    d["max_splits"] = kPagedAttnMaxSplits;
    d["split_max_query_len"] = kPagedAttnSplitMaxQueryLen;
    return d;
  });
}
