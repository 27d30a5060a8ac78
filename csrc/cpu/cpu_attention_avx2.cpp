// The CPU attention kernel for AVX2 + FMA CPUs without AVX-512 (x86-64-v3), on the work units of
// cpu_attention.cpp, with the dot products and value sums written in ymm intrinsics: the generic
// kernel there keeps 16 keys' 16-lane accumulators (32 ymm here) and spilled them (a 1000-token
// prefill ran at ~2 GFLOP/s). Its arithmetic per query is another fixed one than the generic
// kernel's (other bits, as batch-invariant).
//
// Per query, fixed by the query alone:
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
#include <cstdint>
#include <utility>
#include <vector>

#include "cpu_attention_units.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

namespace pyengine::cpu::attention {
namespace {

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
  const int32_t G = p.num_heads / p.num_kv_heads, D = p.head_dim;
  const int32_t nq = (u.i1 - u.i0) * G;  // local query n: position i0 + n / G, head h * G + n % G
  const int32_t keys = std::max(ctx - (q_len - u.i1), 0);
  const int32_t stride = std::max((keys + 7) / 8 * 8, 8);  // scores row: whole groups of 8
  float* scores = aligned64(s.scores, static_cast<size_t>(nq) * (stride + 3 * D));
  s.kv.resize(stride);
  s.sums.resize(nq);
  float* qf = scores + static_cast<size_t>(nq) * stride;  // [nq][D] widened queries
  float* acc = qf + static_cast<size_t>(nq) * D;                   // [nq][2D] even | odd value sums

  auto row_pointers = [&](const void* cache) {
    key_rows<T>(p, r, h, cache, keys, s.kv.data());
    for (int32_t j = keys; j < stride; ++j) s.kv[j] = s.kv[0];  // the last group's padding: scored, never used
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
PE_AVX2 void attention_units(const PagedAttentionParams& p, const Unit* units, int64_t begin, int64_t end) {
  thread_local Scratch scratch;
  if (begin < end) prefetch_row<T>(p, units[begin].row);
  for (int64_t u = begin; u < end; ++u) {
    if (u + 1 < end && units[u + 1].row != units[u].row) prefetch_row<T>(p, units[u + 1].row);
    attend_avx2<T>(p, units[u], scratch);
  }
}

}  // namespace

bool has_avx2_kernel() {
  static const bool have = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return have;
}
bool prefers_avx2_kernel() {
  static const bool prefer = has_avx2_kernel() && !__builtin_cpu_supports("avx512f");
  return prefer;
}
void attention_units_avx2_f32(const PagedAttentionParams& p, const Unit* units, int64_t begin, int64_t end) {
  attention_units<float>(p, units, begin, end);
}
void attention_units_avx2_bf16(const PagedAttentionParams& p, const Unit* units, int64_t begin, int64_t end) {
  attention_units<bf16>(p, units, begin, end);
}

}  // namespace pyengine::cpu::attention
#else
namespace pyengine::cpu::attention {
bool has_avx2_kernel() { return false; }
bool prefers_avx2_kernel() { return false; }
void attention_units_avx2_f32(const PagedAttentionParams&, const Unit*, int64_t, int64_t) {}
void attention_units_avx2_bf16(const PagedAttentionParams&, const Unit*, int64_t, int64_t) {}
}  // namespace pyengine::cpu::attention
#endif
