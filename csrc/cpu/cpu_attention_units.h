// Pieces the CPU attention kernels share (cpu_attention.cpp: the units, the entry and the generic
// kernel; cpu_attention_avx2.cpp: the AVX2 + FMA kernel): work units, per-thread scratch, the
// prefetch of a row's blocks, its key rows, and the AVX2 kernel's entry points.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu_ops.h"
#include "cpu_vec.h"

namespace pyengine::cpu::attention {

// The largest head_dim (a multiple of 16): the query and output accumulators of a head live in
// fixed arrays of kMaxHeadDim / 16 vectors. MLA's latent rows (512 + 64) are the widest user.
constexpr int32_t kMaxHeadDim = 768;

struct Unit {
  int32_t row, i0, i1, head;  // query positions [i0, i1) of the row, kv head `head`
};

struct Scratch {
  std::vector<float> scores;   // [nq, keys] scores, then softmax numerators
  std::vector<const void*> kv; // [ctx] K row pointers, then V row pointers (from the block table)
  std::vector<float> sums;     // [nq] softmax denominators
  std::vector<float> wide;     // AVX2, bf16: one key block's K or V rows widened to fp32
  std::vector<const void*> wide_ptrs;  // [ctx] row pointers into `wide` (the current block's)
};

// Asks for a row's K and V blocks ahead of use. A row's keys are scattered over its blocks (and
// each block interleaves the kv heads), a pattern the hardware prefetcher does not follow; the
// cache of one layer is also evicted by the layer's weights between steps, so without this every
// key row is a memory-latency stall (attention ran ~3x slower inside the model than in isolation).
// A thread asks once per row it reaches (a long row's chunks then find its keys cached).
template <typename T>
PE_INLINE void prefetch_row(const PagedAttentionParams& p, int32_t r) {
  if (r >= p.num_rows) return;
  const int32_t ctx = std::max(p.context_lens[r], 0);
  const int32_t* table = p.block_tables + r * p.block_table_stride;
  const int64_t token_bytes = static_cast<int64_t>(p.num_kv_heads) * p.head_dim * sizeof(T);
  for (int32_t b = 0, j = 0; j < ctx; ++b, j += p.block_size) {  // entries checked by paged_attention()
    const int64_t bytes = std::min(p.block_size, ctx - j) * token_bytes;
    const int64_t offset = static_cast<int64_t>(table[b]) * p.block_size * token_bytes;
    for (const void* cache : {p.k_cache, p.v_cache}) {
      const char* base = static_cast<const char*>(cache) + offset;
      for (int64_t line = 0; line < bytes; line += 64) __builtin_prefetch(base + line);
    }
  }
}

// rows[j] = key j's row of kv head h in `cache` (K or V), j < keys, from row r's block table
// (its entries checked by paged_attention()).
template <typename T>
PE_INLINE void key_rows(const PagedAttentionParams& p, int32_t r, int32_t h, const void* cache, int32_t keys,
                        const void** rows) {
  const int32_t* table = p.block_tables + r * p.block_table_stride;
  const T* base = static_cast<const T*>(cache) + static_cast<int64_t>(h) * p.head_dim;
  const int64_t token = static_cast<int64_t>(p.num_kv_heads) * p.head_dim;
  for (int32_t b = 0, j = 0; j < keys; ++b)
    for (int32_t off = 0; off < p.block_size && j < keys; ++off, ++j)
      rows[j] = base + (static_cast<int64_t>(table[b]) * p.block_size + off) * token;
}

// The AVX2 + FMA kernel (cpu_attention_avx2.cpp). has_avx2_kernel: it is built (x86-64, GCC or
// Clang) and the CPU has AVX2 and FMA; prefers_avx2_kernel: ... and no AVX-512, where the generic
// kernel's AVX-512 clone is the faster one. Per query its arithmetic is fixed by the query alone,
// like the generic kernel's, but it is another arithmetic: the two give different bits.
bool has_avx2_kernel();
bool prefers_avx2_kernel();
void attention_units_avx2_f32(const PagedAttentionParams& p, const Unit* units, int64_t begin, int64_t end);
void attention_units_avx2_bf16(const PagedAttentionParams& p, const Unit* units, int64_t begin, int64_t end);

}  // namespace pyengine::cpu::attention
