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
// switch to another implementation for large steps.
#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "common/common.h"
#include "cpu_ops.h"
#include "cpu_thread_pool.h"
#include "cpu_vec.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

namespace pyengine::cpu {
namespace {

// The largest head_dim (a multiple of 16): the query and output accumulators of a head live in
// fixed arrays of kMaxHeadDim / 16 vectors. MLA's latent rows (512 + 64) are the widest user.
constexpr int32_t kMaxHeadDim = 768;

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
  const int32_t G = p.num_heads / p.num_kv_heads, D = p.head_dim, Hkv = p.num_kv_heads;
  const int32_t nv = NV > 0 ? NV : D / 16;
  constexpr int32_t kMaxNV = NV > 0 ? NV : kMaxHeadDim / 16;  // the register arrays below
  const int32_t qi_begin = u.i0 * G, qi_end = u.i1 * G;
  // Keys any query of the chunk sees: the last one's limit (query i sees [0, ctx - (q_len - 1 - i))).
  const int32_t keys = std::max(ctx - (q_len - u.i1), 0);
  s.scores.resize(static_cast<size_t>(qi_end - qi_begin) * std::max(keys, 1));
  s.kv.resize(std::max(keys, 1));
  s.sums.resize(qi_end - qi_begin);

  const int32_t* table = p.block_tables + r * p.block_table_stride;  // checked by paged_attention()
  auto row_pointers = [&](const void* cache) {
    const T* base = static_cast<const T*>(cache) + static_cast<int64_t>(h) * D;
    for (int32_t b = 0, j = 0; j < keys; ++b)
      for (int32_t off = 0; off < p.block_size && j < keys; ++off, ++j)
        s.kv[j] = base + (static_cast<int64_t>(table[b]) * p.block_size + off) * Hkv * D;
  };

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

#if defined(__x86_64__) && defined(__GNUC__)
#define PE_HAVE_AVX2_ATTENTION 1
// AVX2 + FMA CPUs without AVX-512 (x86-64-v3): the same units and softmax, with the dot products
// and value sums written in ymm intrinsics. The generic code above keeps 16 keys' 16-lane
// accumulators (32 ymm here) and spilled them: a 1000-token prefill ran at ~2 GFLOP/s.
//
// Per query, fixed by the query alone as above:
//   score j = scale * tree8(a_j), a_j = q[0:8] * k_j[0:8], then a_j = fma(q[8c:8c+8], k_j[8c:8c+8], a_j)
//             for c = 1 .. D/8 - 1, and tree8(a) = ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7));
//             keys are scored 8 at a time (a group past the query's limit scores duplicates of
//             key 0 and drops them), so every score comes out of the same instructions;
//   m = max over [0, limit); e_j = exp8(score j - m) (fast_exp's method, its multiply-adds written
//             as FMAs, applied to whole groups of 8); sum = tree8 of an 8-lane sum over the whole
//             groups, then the last limit % 8 terms in order (explicit intrinsics throughout: the
//             compiler's vectorised loop and its scalar epilogue need not round alike, and where
//             the epilogue starts can depend on the buffer's alignment);
//   out lane d = (even_d + odd_d) * (1 / sum), even_d (odd_d) the fma chain over the even (odd)
//             keys in order, starting from 0.
// Keys are taken in blocks of kKeyBlock for all of a unit's queries (scores, then value sums,
// whose chains are stored and reloaded exactly between blocks): the order per query is unchanged.
#define PE_AVX2 __attribute__((target("avx2,fma")))
#define PE_AVX2_INLINE inline __attribute__((target("avx2,fma"), always_inline))

PE_AVX2_INLINE __m256 load8(const float* src) { return _mm256_loadu_ps(src); }
PE_AVX2_INLINE __m256 load8(const bf16* src) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// Scores of 8 keys (tree8 of each key's lane sums, then * scale): two hadd rounds sum pairs then
// quads within each 128-bit half, the halves of each key are added last.
template <typename T>
PE_AVX2_INLINE __m256 score8(const float* qf, const void* const* keys, int32_t d, __m256 scale) {
  const T* k0 = static_cast<const T*>(keys[0]);
  const T* k1 = static_cast<const T*>(keys[1]);
  const T* k2 = static_cast<const T*>(keys[2]);
  const T* k3 = static_cast<const T*>(keys[3]);
  const T* k4 = static_cast<const T*>(keys[4]);
  const T* k5 = static_cast<const T*>(keys[5]);
  const T* k6 = static_cast<const T*>(keys[6]);
  const T* k7 = static_cast<const T*>(keys[7]);
  __m256 q = _mm256_loadu_ps(qf);
  __m256 a0 = _mm256_mul_ps(q, load8(k0)), a1 = _mm256_mul_ps(q, load8(k1));
  __m256 a2 = _mm256_mul_ps(q, load8(k2)), a3 = _mm256_mul_ps(q, load8(k3));
  __m256 a4 = _mm256_mul_ps(q, load8(k4)), a5 = _mm256_mul_ps(q, load8(k5));
  __m256 a6 = _mm256_mul_ps(q, load8(k6)), a7 = _mm256_mul_ps(q, load8(k7));
  for (int32_t c = 8; c < d; c += 8) {
    q = _mm256_loadu_ps(qf + c);
    a0 = _mm256_fmadd_ps(q, load8(k0 + c), a0);
    a1 = _mm256_fmadd_ps(q, load8(k1 + c), a1);
    a2 = _mm256_fmadd_ps(q, load8(k2 + c), a2);
    a3 = _mm256_fmadd_ps(q, load8(k3 + c), a3);
    a4 = _mm256_fmadd_ps(q, load8(k4 + c), a4);
    a5 = _mm256_fmadd_ps(q, load8(k5 + c), a5);
    a6 = _mm256_fmadd_ps(q, load8(k6 + c), a6);
    a7 = _mm256_fmadd_ps(q, load8(k7 + c), a7);
  }
  const __m256 h0123 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  const __m256 h4567 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
  const __m256 sums = _mm256_add_ps(_mm256_permute2f128_ps(h0123, h4567, 0x20),
                                    _mm256_permute2f128_ps(h0123, h4567, 0x31));
  return _mm256_mul_ps(sums, scale);
}

PE_AVX2_INLINE void store8(float* dst, __m256 v) { _mm256_storeu_ps(dst, v); }
PE_AVX2_INLINE void store8(bf16* dst, __m256 v) {
  alignas(32) float f[8];
  _mm256_store_ps(f, v);
  for (int l = 0; l < 8; ++l) dst[l] = from_float<bf16>(f[l]);
}

// Value lanes [d0, d0 + 8 C) of one query over keys [j0, j1) (j0 even): the even and odd key
// chains, carried in acc (even lanes at acc[d], odd at acc[D + d]) from one key block to the next.
template <typename T, int C>
PE_AVX2_INLINE void values(const float* sc, const void* const* vals, int32_t j0, int32_t j1, int32_t d0, int32_t D,
                           float* acc) {
  static_assert(C == 2 || C == 4);
  float* ev = acc + d0;
  float* od = acc + D + d0;
  __m256 e0 = _mm256_loadu_ps(ev), e1 = _mm256_loadu_ps(ev + 8), o0 = _mm256_loadu_ps(od), o1 = _mm256_loadu_ps(od + 8);
  __m256 e2 = e0, e3 = e0, o2 = e0, o3 = e0;
  if constexpr (C == 4) {
    e2 = _mm256_loadu_ps(ev + 16), e3 = _mm256_loadu_ps(ev + 24);
    o2 = _mm256_loadu_ps(od + 16), o3 = _mm256_loadu_ps(od + 24);
  }
  int32_t j = j0;
  for (; j + 1 < j1; j += 2) {
    const T* v0 = static_cast<const T*>(vals[j]) + d0;
    const T* v1 = static_cast<const T*>(vals[j + 1]) + d0;
    const __m256 b0 = _mm256_broadcast_ss(sc + j), b1 = _mm256_broadcast_ss(sc + j + 1);
    e0 = _mm256_fmadd_ps(b0, load8(v0), e0);
    e1 = _mm256_fmadd_ps(b0, load8(v0 + 8), e1);
    o0 = _mm256_fmadd_ps(b1, load8(v1), o0);
    o1 = _mm256_fmadd_ps(b1, load8(v1 + 8), o1);
    if constexpr (C == 4) {
      e2 = _mm256_fmadd_ps(b0, load8(v0 + 16), e2);
      e3 = _mm256_fmadd_ps(b0, load8(v0 + 24), e3);
      o2 = _mm256_fmadd_ps(b1, load8(v1 + 16), o2);
      o3 = _mm256_fmadd_ps(b1, load8(v1 + 24), o3);
    }
  }
  if (j < j1) {  // the query's last key, when its count is odd
    const T* v0 = static_cast<const T*>(vals[j]) + d0;
    const __m256 b0 = _mm256_broadcast_ss(sc + j);
    e0 = _mm256_fmadd_ps(b0, load8(v0), e0);
    e1 = _mm256_fmadd_ps(b0, load8(v0 + 8), e1);
    if constexpr (C == 4) {
      e2 = _mm256_fmadd_ps(b0, load8(v0 + 16), e2);
      e3 = _mm256_fmadd_ps(b0, load8(v0 + 24), e3);
    }
  }
  _mm256_storeu_ps(ev, e0), _mm256_storeu_ps(ev + 8, e1), _mm256_storeu_ps(od, o0), _mm256_storeu_ps(od + 8, o1);
  if constexpr (C == 4) {
    _mm256_storeu_ps(ev + 16, e2), _mm256_storeu_ps(ev + 24, e3);
    _mm256_storeu_ps(od + 16, o2), _mm256_storeu_ps(od + 24, o3);
  }
}

PE_AVX2_INLINE float tree8(__m256 a) {  // ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7))
  const __m256 h = _mm256_hadd_ps(a, a);
  const __m256 hh = _mm256_hadd_ps(h, h);
  return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(hh), _mm256_extractf128_ps(hh, 1)));
}

PE_AVX2_INLINE __m256 exp8(__m256 x) {  // fast_exp (cpu_vec.h), 8 lanes
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
  const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504f), _mm256_set1_ps(0.5f)));
  const __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x));
  const __m256 r2 = _mm256_mul_ps(r, r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_add_ps(_mm256_fmadd_ps(p, r2, r), _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

// sc[0, limit) -> exp(sc - max) in place (whole groups of 8: the row has room); returns (max, sum).
PE_AVX2_INLINE std::pair<float, float> softmax_numerators(float* sc, int32_t limit) {
  float m = sc[0];
  int32_t j = 0;
  if (limit >= 8) {
    __m256 mv = _mm256_loadu_ps(sc);
    for (j = 8; j + 8 <= limit; j += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(sc + j));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, mv);
    for (const float v : lanes) m = std::max(m, v);
  }
  for (; j < limit; ++j) m = std::max(m, sc[j]);
  const __m256 mm = _mm256_set1_ps(m);
  for (j = 0; j < limit; j += 8) _mm256_storeu_ps(sc + j, exp8(_mm256_sub_ps(_mm256_loadu_ps(sc + j), mm)));
  __m256 acc = _mm256_setzero_ps();
  for (j = 0; j + 8 <= limit; j += 8) acc = _mm256_add_ps(acc, _mm256_loadu_ps(sc + j));
  float sum = tree8(acc);
  for (; j < limit; ++j) sum += sc[j];
  return {m, sum};
}

// n floats of v from a 64-byte line on (rows of 8-float multiples then never straddle two lines).
PE_INLINE float* aligned64(std::vector<float>& v, size_t n) {
  v.resize(n + 16);
  const auto address = reinterpret_cast<uintptr_t>(v.data());
  return v.data() + ((64 - address % 64) % 64) / sizeof(float);
}

// Keys per block: the chunk's queries score (then sum) one block of K (V) rows while it sits in
// L1 (64 rows of a 64-dim fp32 head: 16 KiB), instead of each query streaming every key from L2.
constexpr int32_t kKeyBlock = 64;
// bf16 units with at least this many queries widen each key block once (see attend_avx2).
constexpr int32_t kWidenMinQueries = 8;

// Rows s.kv[j0, j1) (bf16) widened into s.wide; returns pointers p with p[j] the row of key j.
template <typename T>
PE_AVX2_INLINE const void* const* widen_block(Scratch& s, int32_t j0, int32_t j1, int32_t d) {
  float* base = aligned64(s.wide, static_cast<size_t>(kKeyBlock) * d);
  s.wide_ptrs.resize(s.kv.size());
  for (int32_t j = j0; j < j1; ++j) {
    const T* src = static_cast<const T*>(s.kv[j]);
    float* dst = base + static_cast<size_t>(j - j0) * d;
    for (int32_t c = 0; c < d; c += 8) _mm256_storeu_ps(dst + c, load8(src + c));
    s.wide_ptrs[j] = dst;
  }
  return s.wide_ptrs.data();
}

template <typename T>
PE_AVX2_INLINE void attend_avx2(const PagedAttentionParams& p, const Unit& u, Scratch& s) {
  const int32_t r = u.row, h = u.head;
  const int32_t q0 = p.query_start_loc[r];
  const int32_t q_len = p.query_start_loc[r + 1] - q0;
  if (q_len <= 0 || u.i0 >= u.i1) return;
  const int32_t ctx = std::max(p.context_lens[r], 0);
  const int32_t G = p.num_heads / p.num_kv_heads, D = p.head_dim, Hkv = p.num_kv_heads;
  const int32_t nq = (u.i1 - u.i0) * G;  // local query n: position i0 + n / G, head h * G + n % G
  const int32_t keys = std::max(ctx - (q_len - u.i1), 0);
  const int32_t stride = std::max((keys + 7) / 8 * 8, 8);  // scores row: whole groups of 8
  float* scores = aligned64(s.scores, static_cast<size_t>(nq) * (stride + 3 * D));
  s.kv.resize(stride);
  s.sums.resize(nq);
  float* qf = scores + static_cast<size_t>(nq) * stride;  // [nq][D] widened queries
  float* acc = qf + static_cast<size_t>(nq) * D;                   // [nq][2D] even | odd value sums

  const int32_t* table = p.block_tables + r * p.block_table_stride;  // checked by paged_attention()
  auto row_pointers = [&](const void* cache) {
    const T* base = static_cast<const T*>(cache) + static_cast<int64_t>(h) * D;
    int32_t j = 0;
    for (int32_t b = 0; j < keys; ++b)
      for (int32_t off = 0; off < p.block_size && j < keys; ++off, ++j)
        s.kv[j] = base + (static_cast<int64_t>(table[b]) * p.block_size + off) * Hkv * D;
    for (; j < stride; ++j) s.kv[j] = s.kv[0];  // the last group's padding: scored, never used
  };
  auto limit_of = [&](int32_t n) { return ctx - (q_len - 1 - (u.i0 + n / G)); };  // keys [0, limit)
  auto head_row = [&](int32_t n) {
    return static_cast<int64_t>(q0 + u.i0 + n / G) * p.num_heads + h * G + n % G;
  };

  const T* q = static_cast<const T*>(p.q);
  T* out = static_cast<T*>(p.out);
  for (int32_t n = 0; n < nq; ++n) {
    const T* qrow = q + (q0 + u.i0 + n / G) * p.q_row_stride + (h * G + n % G) * D;
    for (int32_t c = 0; c < D; ++c) qf[n * D + c] = to_float(qrow[c]);
  }
  // bf16 with many queries: each block's rows widened once into fp32 (exactly) rather than by
  // every query; the same values reach the same FMAs either way.
  const bool widen = std::is_same_v<T, bf16> && nq >= kWidenMinQueries;
  if (keys > 0) {
    const __m256 scale = _mm256_set1_ps(p.scale);
    row_pointers(p.k_cache);
    for (int32_t kb = 0; kb < keys; kb += kKeyBlock) {
      const void* const* wide = widen ? widen_block<T>(s, kb, std::min(stride, kb + kKeyBlock), D) : nullptr;
      for (int32_t n = 0; n < nq; ++n) {
        const int32_t end = std::min(limit_of(n), kb + kKeyBlock);
        float* sc = scores + static_cast<size_t>(n) * stride;
        if (widen)
          for (int32_t j0 = kb; j0 < end; j0 += 8) _mm256_storeu_ps(sc + j0, score8<float>(qf + n * D, wide + j0, D, scale));
        else
          for (int32_t j0 = kb; j0 < end; j0 += 8) _mm256_storeu_ps(sc + j0, score8<T>(qf + n * D, &s.kv[j0], D, scale));
      }
    }
  }
  for (int32_t n = 0; n < nq; ++n) {
    const int32_t limit = limit_of(n);
    if (limit <= 0) {  // no keys (a padding row): output 0, lse -inf
      if (p.lse) p.lse[head_row(n)] = -std::numeric_limits<float>::infinity();
      std::fill_n(out + head_row(n) * D, D, from_float<T>(0.0f));
      continue;
    }
    const auto [m, sum] = softmax_numerators(scores + static_cast<size_t>(n) * stride, limit);
    s.sums[n] = sum;
    if (p.lse) p.lse[head_row(n)] = m + std::log(sum);
  }
  if (keys <= 0) return;
  std::fill_n(acc, static_cast<size_t>(nq) * 2 * D, 0.0f);
  row_pointers(p.v_cache);
  for (int32_t kb = 0; kb < keys; kb += kKeyBlock) {
    const void* const* wide = widen ? widen_block<T>(s, kb, std::min(keys, kb + kKeyBlock), D) : nullptr;
    for (int32_t n = 0; n < nq; ++n) {
      const int32_t end = std::min(limit_of(n), kb + kKeyBlock);
      if (end <= kb) continue;
      const float* sc = scores + static_cast<size_t>(n) * stride;
      int32_t d0 = 0;
      if (widen) {
        for (; d0 + 32 <= D; d0 += 32) values<float, 4>(sc, wide, kb, end, d0, D, acc + n * 2 * D);
        if (d0 < D) values<float, 2>(sc, wide, kb, end, d0, D, acc + n * 2 * D);
      } else {
        for (; d0 + 32 <= D; d0 += 32) values<T, 4>(sc, s.kv.data(), kb, end, d0, D, acc + n * 2 * D);
        if (d0 < D) values<T, 2>(sc, s.kv.data(), kb, end, d0, D, acc + n * 2 * D);  // D % 32 == 16
      }
    }
  }
  for (int32_t n = 0; n < nq; ++n) {
    if (limit_of(n) <= 0) continue;
    const __m256 inv = _mm256_set1_ps(1.0f / s.sums[n]);
    const float* ev = acc + n * 2 * D;
    T* dst = out + head_row(n) * D;
    for (int32_t d = 0; d < D; d += 8)
      store8(dst + d, _mm256_mul_ps(_mm256_add_ps(_mm256_loadu_ps(ev + d), _mm256_loadu_ps(ev + D + d)), inv));
  }
}

template <typename T>
PE_AVX2 void attention_units_avx2(const PagedAttentionParams& p, const Unit* units, int64_t begin, int64_t end) {
  thread_local Scratch scratch;
  if (begin < end) prefetch_row<T>(p, units[begin].row);
  for (int64_t u = begin; u < end; ++u) {
    if (u + 1 < end && units[u + 1].row != units[u].row) prefetch_row<T>(p, units[u + 1].row);
    attend_avx2<T>(p, units[u], scratch);
  }
}

bool use_avx2_attention() {
  static const bool use = !__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx2") &&
                          __builtin_cpu_supports("fma");
  return use;
}
#else
bool use_avx2_attention() { return false; }
template <typename T>
void attention_units_avx2(const PagedAttentionParams&, const Unit*, int64_t, int64_t) {}
#endif

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
  const bool avx2 = use_avx2_attention();
  auto run = [&](int64_t part, int64_t parts) {
    const int64_t begin = std::min(unit_at(part, parts), num_units), end = std::min(unit_at(part + 1, parts), num_units);
    if (avx2)
      p.dtype == DType::kBFloat16 ? attention_units_avx2<bf16>(p, unit_data, begin, end)
                                  : attention_units_avx2<float>(p, unit_data, begin, end);
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
