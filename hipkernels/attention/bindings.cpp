// Thin pybind11 bindings of the GPU kernels: Python passes tensor.data_ptr() values and the
// current stream as integers; the wrappers in pyengine/ops/cuda.py validate shapes and dtypes.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "attention/kv_cache_write.h"
#include "attention/mla_attention.h"
#include "attention/paged_attention.h"
#include "common/binding_utils.h"
#include "common/runtime.h"

namespace py = pybind11;

namespace {

using pyengine_bindings::check;
using pyengine_bindings::ptr;

}  // namespace

void register_attention_kernels(py::module_& k) {
  k.def(
      "reshape_and_cache",
      [](std::uintptr_t key, std::uintptr_t value, std::uintptr_t k_cache, std::uintptr_t v_cache,
         std::uintptr_t slot_mapping, int64_t num_tokens, int num_heads, int head_size,
         int64_t key_stride_token, int64_t key_stride_head, int64_t value_stride_token,
         int64_t value_stride_head, int elem_size, std::uintptr_t stream) {
        ReshapeAndCacheParams p;
        p.key = ptr<const void>(key);
        p.value = ptr<const void>(value);
        p.k_cache = ptr<void>(k_cache);
        p.v_cache = ptr<void>(v_cache);
        p.slot_mapping = ptr<const int64_t>(slot_mapping);
        p.num_tokens = num_tokens;
        p.num_heads = num_heads;
        p.head_size = head_size;
        p.key_stride_token = key_stride_token;
        p.key_stride_head = key_stride_head;
        p.value_stride_token = value_stride_token;
        p.value_stride_head = value_stride_head;
        p.elem_size = elem_size;
        check(launch_reshape_and_cache(p, ptr<void>(stream)), "reshape_and_cache");
      },
      py::arg("key"), py::arg("value"), py::arg("k_cache"), py::arg("v_cache"), py::arg("slot_mapping"),
      py::arg("num_tokens"), py::arg("num_heads"), py::arg("head_size"), py::arg("key_stride_token"),
      py::arg("key_stride_head"), py::arg("value_stride_token"), py::arg("value_stride_head"),
      py::arg("elem_size"), py::arg("stream"));

  k.def(
      "reshape_and_cache_mla",
      [](std::uintptr_t c_kv, std::uintptr_t k_pe, std::uintptr_t kv_cache, std::uintptr_t slot_mapping,
         int64_t num_tokens, int kv_lora_rank, int rope_dim, int64_t c_kv_stride_token,
         int64_t k_pe_stride_token, int elem_size, std::uintptr_t stream) {
        ReshapeAndCacheMlaParams p;
        p.c_kv = ptr<const void>(c_kv);
        p.k_pe = ptr<const void>(k_pe);
        p.kv_cache = ptr<void>(kv_cache);
        p.slot_mapping = ptr<const int64_t>(slot_mapping);
        p.num_tokens = num_tokens;
        p.kv_lora_rank = kv_lora_rank;
        p.rope_dim = rope_dim;
        p.c_kv_stride_token = c_kv_stride_token;
        p.k_pe_stride_token = k_pe_stride_token;
        p.elem_size = elem_size;
        check(launch_reshape_and_cache_mla(p, ptr<void>(stream)), "reshape_and_cache_mla");
      },
      py::arg("c_kv"), py::arg("k_pe"), py::arg("kv_cache"), py::arg("slot_mapping"), py::arg("num_tokens"),
      py::arg("kv_lora_rank"), py::arg("rope_dim"), py::arg("c_kv_stride_token"), py::arg("k_pe_stride_token"),
      py::arg("elem_size"), py::arg("stream"));

  k.def(
      "paged_attention",
      [](std::uintptr_t q, int64_t q_stride_token, int64_t q_stride_head, std::uintptr_t k_cache,
         std::uintptr_t v_cache, std::uintptr_t out, int64_t out_stride_token, int64_t out_stride_head,
         std::uintptr_t lse, std::uintptr_t ws_out, std::uintptr_t ws_lse, std::uintptr_t ws_start,
         std::uintptr_t block_tables, std::uintptr_t query_start_loc, std::uintptr_t context_lens,
         int num_rows, int num_q_heads, int num_kv_heads, int head_dim_qk, int head_dim_v, int block_size,
         int max_blocks_per_row, int max_query_len, int max_splits, float scale, int dtype, bool mla,
         std::uintptr_t stream, int split_block, bool pdl, int num_sms) {
        PagedAttentionParams p;
        p.q = ptr<const void>(q);
        p.q_stride_token = q_stride_token;
        p.q_stride_head = q_stride_head;
        p.k_cache = ptr<const void>(k_cache);
        p.v_cache = ptr<const void>(v_cache);
        p.out = ptr<void>(out);
        p.out_stride_token = out_stride_token;
        p.out_stride_head = out_stride_head;
        p.lse = ptr<float>(lse);
        p.ws_out = ptr<float>(ws_out);
        p.ws_lse = ptr<float>(ws_lse);
        p.ws_start = ptr<const int32_t>(ws_start);
        p.block_tables = ptr<const int32_t>(block_tables);
        p.query_start_loc = ptr<const int32_t>(query_start_loc);
        p.context_lens = ptr<const int32_t>(context_lens);
        p.num_rows = num_rows;
        p.num_q_heads = num_q_heads;
        p.num_kv_heads = num_kv_heads;
        p.head_dim_qk = head_dim_qk;
        p.head_dim_v = head_dim_v;
        p.block_size = block_size;
        p.max_blocks_per_row = max_blocks_per_row;
        p.max_query_len = max_query_len;
        p.max_splits = max_splits;
        p.split_block = split_block;
        p.pdl = pdl;
        p.num_sms = num_sms;
        p.scale = scale;
        p.dtype = dtype;
        if (mla) check(launch_mla_attention(p, ptr<void>(stream)), "paged_attention (mla)");
        else check(launch_paged_attention(p, ptr<void>(stream)), "paged_attention");
      },
      py::arg("q"), py::arg("q_stride_token"), py::arg("q_stride_head"), py::arg("k_cache"), py::arg("v_cache"),
      py::arg("out"), py::arg("out_stride_token"), py::arg("out_stride_head"), py::arg("lse"), py::arg("ws_out"),
      py::arg("ws_lse"), py::arg("ws_start"), py::arg("block_tables"), py::arg("query_start_loc"),
      py::arg("context_lens"), py::arg("num_rows"), py::arg("num_q_heads"), py::arg("num_kv_heads"),
      py::arg("head_dim_qk"), py::arg("head_dim_v"), py::arg("block_size"), py::arg("max_blocks_per_row"),
      py::arg("max_query_len"), py::arg("max_splits"), py::arg("scale"), py::arg("dtype"), py::arg("mla"),
      py::arg("stream"), py::arg("split_block") = kPagedAttnSplitBlock, py::arg("pdl") = false, py::arg("num_sms") = 0);

  k.def("paged_attention_constants", []() {
    py::dict d;
    d["split_block"] = kPagedAttnSplitBlock;
    d["max_splits"] = kPagedAttnMaxSplits;
    d["split_max_query_len"] = kPagedAttnSplitMaxQueryLen;
    return d;
  });
}
