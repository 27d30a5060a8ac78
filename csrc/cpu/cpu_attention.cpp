// Paged attention on the CPU: K/V read in place through the block table (no gather copy), fp32
// math. Work units are (row, chunk of up to kChunkQueries query positions, kv head): every query
// of the chunk's GQA group scores the keys it sees (16 at a time, one shared reduction), then sums
// the values, with the query and its accumulators in registers. Units are split over the pool in
// contiguous ranges of about equal query-key work (4 per thread, claimed dynamically), so one long
// prefill row is spread over every thread and its scratch stays bounded ([kChunkQueries * G, ctx]
// scores per thread).
//
// Per query the arithmetic is fixed by the query alone: scores in key order, one max, exp, one
// sum, and the weighted values summed in key order; chunks and threads only choose which queries
// run where. The same token therefore gets bit-identical output alone, in a batch, as one of the
// 1 + k queries of a verify row, or inside a long prefill chunk, which greedy speculative decoding
// relies on (spec output == plain output). Every step of any length runs here: there is no
// switch to another implementation for large steps. CPUs with AVX2 + FMA but no AVX-512 run the
// same units on the intrinsics kernel of cpu_avx2_kernels.cpp (another fixed arithmetic per
// query; PagedAttentionParams.avx2_kernel asks for it on any AVX2 CPU, e.g. tests).
#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "common/common.h"
#include "cpu_attention_units.h"
#include "cpu_ops.h"
#include "cpu_thread_pool.h"
#include "cpu_vec.h"

namespace pyengine::cpu {
namespace {

using namespace attention;

// 16 fp32 lanes (GCC vector extensions): zmm in the AVX-512 clone, ymm pairs or xmm quads in the
// others. head_dim must be a multiple of 16; every loop below runs over whole vectors, and the
// dot product ends in a fixed reduction tree (the compiler's reduction of a plain loop spilled
// the lanes and added them one by one, and its alignment peeling cost as much again).
using Vec16 = float __attribute__((vector_size(64), aligned(4)));  // std::vector ignores over-alignment of these
using Vec8 = float __attribute__((vector_size(32)));
using Vec4 = float __attribute__((vector_size(16)));
using Half16 = uint16_t __attribute__((vector_size(32)));
using Word16 = uint32_t __attribute__((vector_size(64)));

PE_INLINE Vec16 load16(const float* src) {
  Vec16 v;
  std::memcpy(&v, src, sizeof(v));
  return v;
}
PE_INLINE Vec16 load16(const bf16* src) {  // bf16 -> fp32 is a 16-bit shift
  Half16 h;
  std::memcpy(&h, src, sizeof(h));
  const Word16 w = __builtin_convertvector(h, Word16) << 16;
  Vec16 v;
  std::memcpy(&v, &w, sizeof(v));
  return v;
}

PE_INLINE float reduce(Vec16 acc) {  // a fixed tree: the same sum in every clone and call
  const Vec8 s8 = __builtin_shufflevector(acc, acc, 0, 1, 2, 3, 4, 5, 6, 7) +
                  __builtin_shufflevector(acc, acc, 8, 9, 10, 11, 12, 13, 14, 15);
  const Vec4 s4 = __builtin_shufflevector(s8, s8, 0, 1, 2, 3) + __builtin_shufflevector(s8, s8, 4, 5, 6, 7);
  return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

// The 16 sums of 16 vectors, in order, by the same tree as reduce() applies to each (halves, then
// quarters, ...): 30 shuffles and 15 adds instead of 16 separate reductions.
PE_INLINE Vec16 reduce16(Vec16 (&a)[16]) {
  Vec16 t[8], u[4], w[2];
  for (int k = 0; k < 8; ++k)
    t[k] = __builtin_shufflevector(a[2 * k], a[2 * k + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(a[2 * k], a[2 * k + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int k = 0; k < 4; ++k)
    u[k] = __builtin_shufflevector(t[2 * k], t[2 * k + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(t[2 * k], t[2 * k + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int k = 0; k < 2; ++k)
    w[k] = __builtin_shufflevector(u[2 * k], u[2 * k + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           __builtin_shufflevector(u[2 * k], u[2 * k + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  // Lane l of w[0] pairs with lane l + 1 as reduce()'s last step does: (s0 + s2) + (s1 + s3).
  return __builtin_shufflevector(w[0], w[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(w[0], w[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

// Sum and max of n floats in 16 lanes then a fixed tree: vectorised, and still one order per n.
PE_INLINE float sum_fixed(const float* x, int32_t n) {
  Vec16 acc = {};
  int32_t j = 0;
  for (; j + 16 <= n; j += 16) acc += load16(x + j);
  float tail = 0.0f;
  for (; j < n; ++j) tail += x[j];
  return reduce(acc) + tail;
}

PE_INLINE float max_of(const float* x, int32_t n) {
  float m = x[0];
  int32_t j = 0;
  if (n >= 16) {
    Vec16 acc = load16(x);
    for (j = 16; j + 16 <= n; j += 16) {
      const Vec16 v = load16(x + j);
      acc = v > acc ? v : acc;
    }
    for (int32_t l = 0; l < 16; ++l) m = std::max(m, acc[l]);
  }
  for (; j < n; ++j) m = std::max(m, x[j]);
  return m;
}

// Below this many query-key pairs (plus one per row) one thread is faster than waking another.
constexpr int64_t kMinParallelWork = 256;
// Query positions of a row per work unit: bounds the scores scratch and lets threads share a row.
constexpr int32_t kChunkQueries = 32;


// Query positions [i0, i1) of row r for kv head h, with its whole GQA group. NV = head_dim / 16
// when known at compile time (the query and accumulators then live in registers), 0 for any
// multiple of 16. Queries are ordered (i, g): index i * G + g is query i of the row for head h * G + g.
template <typename T, int NV>
PE_INLINE void attend(const PagedAttentionParams& p, const Unit& u, Scratch& s) {
  const int32_t r = u.row, h = u.head;
  const int32_t q0 = p.query_start_loc[r];
  const int32_t q_len = p.query_start_loc[r + 1] - q0;
  if (q_len <= 0 || u.i0 >= u.i1) return;
  const int32_t ctx = std::max(p.context_lens[r], 0);
  const int32_t G = p.num_heads / p.num_kv_heads, D = p.head_dim;
  const int32_t nv = NV > 0 ? NV : D / 16;
  constexpr int32_t kMaxNV = NV > 0 ? NV : kMaxHeadDim / 16;  // the register arrays below
  const int32_t qi_begin = u.i0 * G, qi_end = u.i1 * G;
  // Keys any query of the chunk sees: the last one's limit (query i sees [0, ctx - (q_len - 1 - i))).
  const int32_t keys = std::max(ctx - (q_len - u.i1), 0);
  s.scores.resize(static_cast<size_t>(qi_end - qi_begin) * std::max(keys, 1));
  s.kv.resize(std::max(keys, 1));
  s.sums.resize(qi_end - qi_begin);

  auto row_pointers = [&](const void* cache) { key_rows<T>(p, r, h, cache, keys, s.kv.data()); };

  const T* q = static_cast<const T*>(p.q);
  T* out = static_cast<T*>(p.out);
  row_pointers(p.k_cache);
  for (int32_t qi = qi_begin; qi < qi_end; ++qi) {
    const int32_t i = qi / G;
    const int64_t head_row = static_cast<int64_t>(q0 + i) * p.num_heads + h * G + qi % G;
    Vec16 qv[kMaxNV];
    for (int32_t v = 0; v < nv; ++v) qv[v] = load16(q + (q0 + i) * p.q_row_stride + (h * G + qi % G) * D + 16 * v);
    const int32_t limit = ctx - (q_len - 1 - i);  // query i sees keys [0, limit)
    float* sc = &s.scores[static_cast<size_t>(qi - qi_begin) * keys];
    int32_t j0 = 0;
    for (; j0 + 16 <= limit; j0 += 16) {  // 16 keys at a time, one shared reduction
      Vec16 acc[16];
      for (int32_t k = 0; k < 16; ++k) {
        const T* key = static_cast<const T*>(s.kv[j0 + k]);
        acc[k] = qv[0] * load16(key);
        for (int32_t v = 1; v < nv; ++v) acc[k] += qv[v] * load16(key + 16 * v);
      }
      const Vec16 scores = reduce16(acc) * p.scale;
      std::memcpy(sc + j0, &scores, sizeof(scores));
    }
    for (int32_t j = j0; j < limit; ++j) {
      const T* k = static_cast<const T*>(s.kv[j]);
      Vec16 acc = qv[0] * load16(k);
      for (int32_t v = 1; v < nv; ++v) acc += qv[v] * load16(k + 16 * v);
      sc[j] = reduce(acc) * p.scale;
    }
    if (limit <= 0) {  // no keys (a padding row): output 0, lse -inf
      if (p.lse) p.lse[head_row] = -std::numeric_limits<float>::infinity();
      std::fill_n(out + head_row * D, D, from_float<T>(0.0f));
      continue;
    }
    const float m = max_of(sc, limit);
    for (int32_t j = 0; j < limit; ++j) sc[j] = fast_exp(sc[j] - m);  // vectorised
    s.sums[qi - qi_begin] = sum_fixed(sc, limit);
    if (p.lse) p.lse[head_row] = m + std::log(s.sums[qi - qi_begin]);
  }
  row_pointers(p.v_cache);
  for (int32_t qi = qi_begin; qi < qi_end; ++qi) {
    const int32_t i = qi / G;
    const int64_t head_row = static_cast<int64_t>(q0 + i) * p.num_heads + h * G + qi % G;
    const int32_t limit = ctx - (q_len - 1 - i);
    if (limit <= 0) continue;
    const float* sc = &s.scores[static_cast<size_t>(qi - qi_begin) * keys];
    // Two accumulator sets (even and odd keys) halve the FMA dependency chain; the order of the
    // sum is still fixed by the key count alone.
    Vec16 even[kMaxNV], odd[kMaxNV];
    for (int32_t v = 0; v < nv; ++v) even[v] = odd[v] = Vec16{};
    int32_t j = 0;
    for (; j + 1 < limit; j += 2) {
      const T* v0 = static_cast<const T*>(s.kv[j]);
      const T* v1 = static_cast<const T*>(s.kv[j + 1]);
      for (int32_t v = 0; v < nv; ++v) {
        even[v] += sc[j] * load16(v0 + 16 * v);
        odd[v] += sc[j + 1] * load16(v1 + 16 * v);
      }
    }
    if (j < limit) {
      const T* v0 = static_cast<const T*>(s.kv[j]);
      for (int32_t v = 0; v < nv; ++v) even[v] += sc[j] * load16(v0 + 16 * v);
    }
    const float inv = 1.0f / s.sums[qi - qi_begin];
    T* dst = out + head_row * D;
    for (int32_t v = 0; v < nv; ++v) {
      const Vec16 o = (even[v] + odd[v]) * inv;
      for (int32_t l = 0; l < 16; ++l) dst[16 * v + l] = from_float<T>(o[l]);
    }
  }
}


// Units [begin, end) in order, prefetching the next unit's row (when it is another row) while
// the current one computes.
template <typename T, int NV>
PE_INLINE void attend_units(const PagedAttentionParams& p, const Unit* units, int64_t begin, int64_t end,
                            Scratch& s) {
  if (begin < end) prefetch_row<T>(p, units[begin].row);
  for (int64_t u = begin; u < end; ++u) {
    if (u + 1 < end && units[u + 1].row != units[u].row) prefetch_row<T>(p, units[u + 1].row);
    attend<T, NV>(p, units[u], s);
  }
}

template <typename T>
PE_INLINE void attend_units_dispatch(const PagedAttentionParams& p, const Unit* units, int64_t begin, int64_t end) {
  thread_local Scratch scratch;
  switch (p.head_dim) {
    case 64: return attend_units<T, 4>(p, units, begin, end, scratch);
    case 128: return attend_units<T, 8>(p, units, begin, end, scratch);
    default: return attend_units<T, 0>(p, units, begin, end, scratch);
  }
}

// The cloned entry points: the math must be compiled inside them (a lambda handed to the pool
// would be compiled for baseline x86-64 only, which made attention ~6x slower).
PE_CPU_CLONES void attention_units_f32(const PagedAttentionParams& p, const Unit* units, int64_t begin, int64_t end) {
  attend_units_dispatch<float>(p, units, begin, end);
}
PE_CPU_CLONES void attention_units_bf16(const PagedAttentionParams& p, const Unit* units, int64_t begin, int64_t end) {
  attend_units_dispatch<bf16>(p, units, begin, end);
}


}  // namespace

std::string paged_attention(const PagedAttentionParams& p) {
  if (p.num_kv_heads <= 0 || p.num_heads % p.num_kv_heads != 0)
    return concat("num_heads ", p.num_heads, " is not a multiple of num_kv_heads ", p.num_kv_heads);
  if (p.head_dim <= 0 || p.head_dim % 16 != 0 || p.head_dim > kMaxHeadDim)
    return concat("head_dim must be a positive multiple of 16 up to ", kMaxHeadDim, ", got ", p.head_dim);
  if (p.block_size <= 0) return "block_size must be positive";
  for (int32_t r = 0; r < p.num_rows; ++r) {  // every block read must exist, before any work starts
    const int32_t* table = p.block_tables + r * p.block_table_stride;
    for (int32_t b = 0; b < (std::max(p.context_lens[r], 0) + p.block_size - 1) / p.block_size; ++b)
      if (table[b] < 0 || table[b] >= p.num_blocks)
        return concat("block table row ", r, " entry ", b, " = ", table[b], " is outside the cache's ", p.num_blocks,
                      " blocks");
  }
  // Units in (row, chunk, kv head) order; threads take contiguous unit ranges of about equal work
  // (query-key pairs, plus one per unit). A query's result does not depend on which unit or
  // thread computes it.
  thread_local std::vector<Unit> units;
  thread_local std::vector<int64_t> work;
  units.clear();
  work.assign(1, 0);
  const int32_t G = p.num_heads / p.num_kv_heads;
  for (int32_t r = 0; r < p.num_rows; ++r) {
    const int32_t q_len = p.query_start_loc[r + 1] - p.query_start_loc[r];
    const int64_t ctx = std::max(p.context_lens[r], 0);
    for (int32_t i0 = 0; i0 < q_len; i0 += kChunkQueries) {
      const int32_t i1 = std::min(q_len, i0 + kChunkQueries);
      // Keys seen by queries i0 .. i1 - 1: the sum of ctx - (q_len - 1 - i), each at least 0.
      int64_t pairs = 0;
      for (int32_t i = i0; i < i1; ++i) pairs += std::max<int64_t>(ctx - (q_len - 1 - i), 0);
      for (int32_t h = 0; h < p.num_kv_heads; ++h) {
        units.push_back({r, i0, i1, h});
        work.push_back(work.back() + pairs * G + 1);
      }
    }
  }
  const Unit* unit_data = units.data();
  const int64_t num_units = static_cast<int64_t>(units.size());
  const std::vector<int64_t>& w = work;  // the caller's (a worker's own thread_local would be empty)
  auto unit_at = [&](int64_t part, int64_t parts) {
    if (part == parts) return num_units;
    const int64_t target = split_begin(w.back(), part, parts);
    return static_cast<int64_t>(std::lower_bound(w.begin(), w.end(), target) - w.begin());
  };
  if (p.avx2_kernel && !has_avx2_kernel()) return "the AVX2 attention kernel needs an x86-64 CPU with AVX2 and FMA";
  const bool avx2 = p.avx2_kernel || prefers_avx2_kernel();
  auto run = [&](int64_t part, int64_t parts) {
    const int64_t begin = std::min(unit_at(part, parts), num_units), end = std::min(unit_at(part + 1, parts), num_units);
    if (avx2)
      p.dtype == DType::kBFloat16 ? attention_units_avx2_bf16(p, unit_data, begin, end)
                                  : attention_units_avx2_f32(p, unit_data, begin, end);
    else
      p.dtype == DType::kBFloat16 ? attention_units_bf16(p, unit_data, begin, end)
                                  : attention_units_f32(p, unit_data, begin, end);
  };
  if (!p.use_pool || work.back() < kMinParallelWork) {
    run(0, 1);
  } else {  // ranges of about equal work, claimed by the pool's threads as they come
    ThreadPool& pool = shared_pool();
    const int64_t parts = std::min<int64_t>(num_units, 4 * pool.num_threads());
    pool.run_chunks(parts, [&](int64_t c) { run(c, parts); });
  }
  return {};
}

}  // namespace pyengine::cpu
