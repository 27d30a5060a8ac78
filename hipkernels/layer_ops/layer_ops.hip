// Per-token layer ops: rms_norm, fused_add_rms_norm, silu_and_mul, rope_and_cache (semantics in
// layer_ops.h). Each kernel is a template over the storage type T and the elements per access N:
// N * sizeof(T) == 16 (one 16-byte vector) when every row start and stride allows it, else N == 1.
//
// Bit-level agreement with the PyTorch reference: products and sums that the reference rounds
// separately (RoPE's x * cos + rotate(x) * sin is three fp32 kernels there) use __fmul_rn /
// __fadd_rn so the compiler cannot contract them into an FMA with a different rounding. The only
// intended difference is the order of the RMS sum of squares (a block reduction here, torch's own
// reduction there), a few fp32 ulps of the scale before the one rounding on store.
//
// Batch invariance: every token is one block (norms) or a fixed set of threads (the others), with a
// launch shape that depends on the row width alone, so a token's reduction order and its result
// are the same whatever else is in the launch.
#include <type_traits>

#include "common/hip_compat.h"
#include "layer_ops/layer_ops.h"

namespace {

// One element of storage type T <-> float, on its raw bits (hip_compat.h's Io does the conversion).
template <typename T>
struct Cvt {
  using Raw = typename std::conditional<std::is_same<T, float>::value, float, uint16_t>::type;
  static_assert(sizeof(Raw) == sizeof(T), "a storage type is its raw bits");
  static PE_DEVICE float load(Raw b) {
    T v;
    __builtin_memcpy(&v, &b, sizeof(T));
    return Io<T>::ld(&v);
  }
  static PE_DEVICE Raw store(float f) {
    T v;
    Io<T>::st(&v, f);
    Raw b;
    __builtin_memcpy(&b, &v, sizeof(T));
    return b;
  }
};

// N consecutive elements as one memory access: a 16-byte vector, or a single element (N == 1).
template <typename T, int N>
struct Chunk {
  using Raw = typename Cvt<T>::Raw;
  static constexpr bool kVector = N * sizeof(Raw) == 16;
  static_assert(kVector || N == 1, "a chunk is 16 bytes or one element");
  using Bits = typename std::conditional<kVector, uint4, Raw>::type;

  static PE_DEVICE Bits load(const Raw* p) { return *reinterpret_cast<const Bits*>(p); }
  static PE_DEVICE void store(Raw* p, Bits b) { *reinterpret_cast<Bits*>(p) = b; }

  static PE_DEVICE void unpack(Bits b, float (&f)[N]) {
    if constexpr (!kVector) {
      f[0] = Cvt<T>::load(b);
    } else if constexpr (sizeof(Raw) == 2) {
      PeVec8<T>::to_float(b, f);
    } else {
      f[0] = __uint_as_float(b.x);
      f[1] = __uint_as_float(b.y);
      f[2] = __uint_as_float(b.z);
      f[3] = __uint_as_float(b.w);
    }
  }

  static PE_DEVICE Bits pack(const float (&f)[N]) {
    if constexpr (!kVector) {
      return Cvt<T>::store(f[0]);
    } else if constexpr (sizeof(Raw) == 2) {
      uint32_t w[4];
#pragma unroll
      for (int i = 0; i < 4; ++i)
        w[i] = (uint32_t)Cvt<T>::store(f[2 * i]) | ((uint32_t)Cvt<T>::store(f[2 * i + 1]) << 16);
      return make_uint4(w[0], w[1], w[2], w[3]);
    } else {
      return make_uint4(__float_as_uint(f[0]), __float_as_uint(f[1]), __float_as_uint(f[2]), __float_as_uint(f[3]));
    }
  }
};

// ---- rms_norm / fused_add_rms_norm ---------------------------------------------------------------

constexpr int kNormMaxThreads = 1024;
// Chunks a thread keeps in registers between the reduction and the output; wider rows re-read
// the rest (from L1/L2) instead of spilling.
constexpr int kNormRegChunks = 2;

// Sum over the block, the same order in every thread and every launch (fixed block shape).
PE_DEVICE float block_sum(float v, float* partial) {
#pragma unroll
  for (int o = PE_WARP_SIZE / 2; o > 0; o >>= 1) v += pe_shfl_xor(v, o);
  const int warp = threadIdx.x / PE_WARP_SIZE;
  if (threadIdx.x % PE_WARP_SIZE == 0) partial[warp] = v;
  __syncthreads();
  float total = 0.f;
  const int warps = blockDim.x / PE_WARP_SIZE;
  for (int w = 0; w < warps; ++w) total += partial[w];
  return total;
}

template <typename T, int N>
PE_DEVICE float sum_squares(const float (&f)[N]) {
  float s = 0.f;
#pragma unroll
  for (int j = 0; j < N; ++j) s += f[j] * f[j];
  return s;
}

// The raw chunks a thread reads for chunk i of token t: x, the residual (fused form) and the weight.
template <typename T, int N, bool kAdd>
struct NormLoads {
  using C = Chunk<T, N>;
  typename C::Bits x, res, w;

  PE_DEVICE void load(const RmsNormParams& p, int64_t t, int i) {
    using Raw = typename C::Raw;
    x = C::load(static_cast<const Raw*>(p.x) + t * p.x_stride + (int64_t)i * N);
    if constexpr (kAdd) res = C::load(static_cast<const Raw*>(p.residual) + t * p.residual_stride + (int64_t)i * N);
    w = C::load(static_cast<const Raw*>(p.weight) + (int64_t)i * N);
  }

  // The norm's input as floats: x, or for the fused form the rounded x + residual, which is also
  // written back to the residual (the norm reads the rounded sum, as the reference does).
  PE_DEVICE void input(const RmsNormParams& p, int64_t t, int i, float (&f)[N]) const {
    C::unpack(x, f);
    if constexpr (kAdd) {
      float r[N];
      C::unpack(res, r);
#pragma unroll
      for (int j = 0; j < N; ++j) f[j] = r[j] + f[j];
      const typename C::Bits sum = C::pack(f);
      C::store(static_cast<typename C::Raw*>(p.residual) + t * p.residual_stride + (int64_t)i * N, sum);
      C::unpack(sum, f);
    }
  }

  PE_DEVICE void output(const RmsNormParams& p, int64_t t, int i, const float (&f)[N], float inv_rms) const {
    float wf[N], o[N];
    C::unpack(w, wf);
#pragma unroll
    for (int j = 0; j < N; ++j) o[j] = __fmul_rn(__fmul_rn(f[j], inv_rms), wf[j]);
    C::store(static_cast<typename C::Raw*>(p.out) + t * p.out_stride + (int64_t)i * N, C::pack(o));
  }
};

// One block per token. Every load of the register-held chunks (x, residual and weight) is issued
// before the first use, so a token costs about one memory latency, the reduction, and the stores.
template <typename T, int N, bool kAdd>
__global__ void __launch_bounds__(kNormMaxThreads) rms_norm_kernel(RmsNormParams p, float inv_hidden) {
  __shared__ float partial[kNormMaxThreads / PE_WARP_SIZE];
  pe_pdl_launch_dependents();  // a PDL-launched GEMM after the norm may start streaming its weights
  const int64_t t = blockIdx.x;
  const int chunks = p.hidden / N;
  NormLoads<T, N, kAdd> in[kNormRegChunks];
  float v[kNormRegChunks][N];
#pragma unroll
  for (int k = 0; k < kNormRegChunks; ++k) {
    const int i = threadIdx.x + k * blockDim.x;
    if (i < chunks) in[k].load(p, t, i);
  }
  float ss = 0.f;
#pragma unroll
  for (int k = 0; k < kNormRegChunks; ++k) {
    const int i = threadIdx.x + k * blockDim.x;
    if (i < chunks) {
      in[k].input(p, t, i, v[k]);
      ss += sum_squares<T, N>(v[k]);
    }
  }
  // Rows wider than the registers hold (kNormRegChunks chunks per thread of a full block): the
  // rest is read twice, the second time from the residual this thread wrote (fused form: its
  // output aliases x) or from x.
  for (int i = threadIdx.x + kNormRegChunks * blockDim.x; i < chunks; i += blockDim.x) {
    NormLoads<T, N, kAdd> extra;
    extra.load(p, t, i);
    float f[N];
    extra.input(p, t, i, f);
    ss += sum_squares<T, N>(f);
  }
  const float inv_rms = rsqrtf(__fadd_rn(__fmul_rn(block_sum(ss, partial), inv_hidden), p.eps));
#pragma unroll
  for (int k = 0; k < kNormRegChunks; ++k) {
    const int i = threadIdx.x + k * blockDim.x;
    if (i < chunks) in[k].output(p, t, i, v[k], inv_rms);
  }
  for (int i = threadIdx.x + kNormRegChunks * blockDim.x; i < chunks; i += blockDim.x) {
    NormLoads<T, N, false> again;
    RmsNormParams src = p;
    if (kAdd) {
      src.x = p.residual;
      src.x_stride = p.residual_stride;
    }
    again.load(src, t, i);
    float f[N];
    again.input(src, t, i, f);
    again.output(p, t, i, f, inv_rms);
  }
}

// ---- silu_and_mul -------------------------------------------------------------------------------

constexpr int kEltThreads = 256;

template <typename T, int N>
__global__ void __launch_bounds__(kEltThreads) silu_and_mul_kernel(SiluAndMulParams p) {
  using C = Chunk<T, N>;
  using Raw = typename C::Raw;
  pe_pdl_launch_dependents();  // as in rms_norm: the down projection's weights may start streaming
  const int64_t chunks_per_row = p.inter / N;
  const int64_t idx = (int64_t)blockIdx.x * kEltThreads + threadIdx.x;
  if (idx >= p.num_tokens * chunks_per_row) return;
  const int64_t t = idx / chunks_per_row;
  const int64_t i = (idx - t * chunks_per_row) * N;
  const Raw* x = static_cast<const Raw*>(p.x) + t * p.x_stride + i;
  float g[N], u[N];
  C::unpack(C::load(x), g);
  C::unpack(C::load(x + p.inter), u);
#pragma unroll
  for (int j = 0; j < N; ++j) g[j] = __fmul_rn(g[j] / (1.0f + expf(-g[j])), u[j]);  // torch's silu
  C::store(static_cast<Raw*>(p.out) + t * p.out_stride + i, C::pack(g));
}

// ---- rope_and_cache -----------------------------------------------------------------------------

constexpr int kRopeThreads = 128;

// Work units of one token, in this order: [a rotation pair per (head, chunk of the first half) of
// q and k, or a k copy per (kv head, chunk) when there is no rotation] [a v copy per (kv head,
// chunk)]. A rotation unit holds the chunk at j and its partner at j + D/2, so it rotates in place
// with no other thread reading what it writes.
template <bool kRotate>
int rope_units(const RopeAndCacheParams& p, int n) {
  const int first = kRotate ? (p.num_q_heads + p.num_kv_heads) * (p.head_dim / 2 / n) : p.num_kv_heads * (p.head_dim / n);
  return first + p.num_kv_heads * (p.head_dim / n);
}

template <typename T, int N, bool kRotate>
__global__ void __launch_bounds__(kRopeThreads) rope_and_cache_kernel(RopeAndCacheParams p) {
  pe_pdl_launch_dependents();  // a PDL-launched attention kernel may start; it waits for this one first
  using C = Chunk<T, N>;
  using Raw = typename C::Raw;
  const int64_t t = blockIdx.x;
  int u = blockIdx.y * kRopeThreads + threadIdx.x;
  const int d = p.head_dim;
  const int64_t slot = p.slot_mapping[t];
  Raw* qk = static_cast<Raw*>(p.qk) + t * p.qk_stride_token;
  const int64_t cache_row = slot * p.num_kv_heads * d;  // this slot's first element in either cache
  const int chunks_per_head = d / N;
  if constexpr (kRotate) {
    const int half = d / 2;
    const int pairs_per_head = half / N;
    const int pairs = (p.num_q_heads + p.num_kv_heads) * pairs_per_head;
    if (u < pairs) {
      const int h = u / pairs_per_head;
      const int j = (u - h * pairs_per_head) * N;
      Raw* lo_p = qk + h * p.qk_stride_head + j;
      const Raw* cos_p = static_cast<const Raw*>(p.cos) + t * p.cos_stride_token + j;
      const Raw* sin_p = static_cast<const Raw*>(p.sin) + t * p.sin_stride_token + j;
      float lo[N], hi[N], cl[N], ch[N], sl[N], sh[N];
      C::unpack(C::load(lo_p), lo);
      C::unpack(C::load(lo_p + half), hi);
      C::unpack(C::load(cos_p), cl);
      C::unpack(C::load(cos_p + half), ch);
      C::unpack(C::load(sin_p), sl);
      C::unpack(C::load(sin_p + half), sh);
      float out_lo[N], out_hi[N];
#pragma unroll
      for (int e = 0; e < N; ++e) {  // rotate(x) = [x_hi, x_lo]; rotate_half's sign lives in sin
        out_lo[e] = __fadd_rn(__fmul_rn(lo[e], cl[e]), __fmul_rn(hi[e], sl[e]));
        out_hi[e] = __fadd_rn(__fmul_rn(hi[e], ch[e]), __fmul_rn(lo[e], sh[e]));
      }
      const typename C::Bits a = C::pack(out_lo), b = C::pack(out_hi);
      C::store(lo_p, a);
      C::store(lo_p + half, b);
      if (h >= p.num_q_heads && slot >= 0) {
        Raw* kc = static_cast<Raw*>(p.k_cache) + cache_row + (int64_t)(h - p.num_q_heads) * d + j;
        C::store(kc, a);
        C::store(kc + half, b);
      }
      return;
    }
    u -= pairs;
  } else {
    const int k_chunks = p.num_kv_heads * chunks_per_head;
    if (u < k_chunks) {
      if (slot < 0) return;
      const int h = u / chunks_per_head;
      const int j = (u - h * chunks_per_head) * N;
      const Raw* src = qk + (int64_t)(p.num_q_heads + h) * p.qk_stride_head + j;
      C::store(static_cast<Raw*>(p.k_cache) + cache_row + (int64_t)h * d + j, C::load(src));
      return;
    }
    u -= k_chunks;
  }
  if (slot < 0 || u >= p.num_kv_heads * chunks_per_head) return;
  const int h = u / chunks_per_head;
  const int j = (u - h * chunks_per_head) * N;
  const Raw* src = static_cast<const Raw*>(p.v) + t * p.v_stride_token + h * p.v_stride_head + j;
  C::store(static_cast<Raw*>(p.v_cache) + cache_row + (int64_t)h * d + j, C::load(src));
}

// ---- launchers ----------------------------------------------------------------------------------

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

// Elements per 16-byte access for a dtype code, 0 for an unknown one.
int vec_elems(int dtype) { return dtype == PE_FLOAT32 ? 4 : (dtype == PE_FLOAT16 || dtype == PE_BFLOAT16) ? 8 : 0; }

// Runs fn.template operator()<T>() for the storage type of a dtype code; -1 for an unknown code.
template <typename Fn>
int by_dtype(int dtype, Fn&& fn) {
  switch (dtype) {
    case PE_FLOAT16: return fn(pe_half{});
    case PE_BFLOAT16: return fn(pe_bf16{});
    case PE_FLOAT32: return fn(float{});
    default: return -1;
  }
}

template <bool kAdd>
int launch_norm(const RmsNormParams& p, void* stream) {
  if (p.num_tokens == 0 || p.hidden == 0) return 0;
  const int n = vec_elems(p.dtype);
  if (n == 0) return -1;
  bool vec = p.hidden % n == 0 && p.x_stride % n == 0 && p.out_stride % n == 0 && aligned16(p.x) &&
             aligned16(p.out) && aligned16(p.weight);
  if (kAdd) vec = vec && p.residual_stride % n == 0 && aligned16(p.residual);
  const int chunks = vec ? p.hidden / n : p.hidden;
  // Threads for kNormRegChunks chunks each, whole warps, at most one block's worth: a function
  // of the row width only (batch invariance).
  const int want = (chunks + kNormRegChunks - 1) / kNormRegChunks;
  int threads = (want + PE_WARP_SIZE - 1) / PE_WARP_SIZE * PE_WARP_SIZE;
  threads = threads < kNormMaxThreads ? threads : kNormMaxThreads;
  const float inv_hidden = 1.0f / (float)p.hidden;  // torch's mean multiplies by 1/N
  const peStream_t s = static_cast<peStream_t>(stream);
  const dim3 grid((unsigned)p.num_tokens);
  return by_dtype(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    constexpr int kVec = 16 / sizeof(typename Cvt<T>::Raw);
    if (vec)
      rms_norm_kernel<T, kVec, kAdd><<<grid, threads, 0, s>>>(p, inv_hidden);
    else
      rms_norm_kernel<T, 1, kAdd><<<grid, threads, 0, s>>>(p, inv_hidden);
    return static_cast<int>(peGetLastError());
  });
}

}  // namespace

int launch_rms_norm(const RmsNormParams& p, void* stream) { return launch_norm<false>(p, stream); }

int launch_fused_add_rms_norm(const RmsNormParams& p, void* stream) {
  if (p.residual == nullptr || p.out != p.x || p.out_stride != p.x_stride) return -1;  // in place only
  return launch_norm<true>(p, stream);
}

int launch_silu_and_mul(const SiluAndMulParams& p, void* stream) {
  if (p.num_tokens == 0 || p.inter == 0) return 0;
  const int n = vec_elems(p.dtype);
  if (n == 0) return -1;
  const bool vec = p.inter % n == 0 && p.x_stride % n == 0 && p.out_stride % n == 0 && aligned16(p.x) && aligned16(p.out);
  const int64_t work = p.num_tokens * (vec ? p.inter / n : p.inter);
  const dim3 grid((unsigned)((work + kEltThreads - 1) / kEltThreads));
  const peStream_t s = static_cast<peStream_t>(stream);
  return by_dtype(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    constexpr int kVec = 16 / sizeof(typename Cvt<T>::Raw);
    if (vec)
      silu_and_mul_kernel<T, kVec><<<grid, kEltThreads, 0, s>>>(p);
    else
      silu_and_mul_kernel<T, 1><<<grid, kEltThreads, 0, s>>>(p);
    return static_cast<int>(peGetLastError());
  });
}

int launch_rope_and_cache(const RopeAndCacheParams& p, void* stream) {
  if (p.num_tokens == 0) return 0;
  const int n = vec_elems(p.dtype);
  const bool rotate = p.cos != nullptr;
  if (n == 0 || p.head_dim <= 0 || (rotate && (p.sin == nullptr || p.head_dim % 2 != 0))) return -1;
  bool vec = p.head_dim % (rotate ? 2 * n : n) == 0 && p.qk_stride_token % n == 0 && p.qk_stride_head % n == 0 &&
             p.v_stride_token % n == 0 && p.v_stride_head % n == 0 && aligned16(p.qk) && aligned16(p.v) &&
             aligned16(p.k_cache) && aligned16(p.v_cache);
  if (rotate)
    vec = vec && p.cos_stride_token % n == 0 && p.sin_stride_token % n == 0 && aligned16(p.cos) && aligned16(p.sin);
  const int units = rotate ? rope_units<true>(p, vec ? n : 1) : rope_units<false>(p, vec ? n : 1);
  if (units == 0) return 0;
  const dim3 grid((unsigned)p.num_tokens, (unsigned)((units + kRopeThreads - 1) / kRopeThreads));
  const peStream_t s = static_cast<peStream_t>(stream);
  return by_dtype(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    constexpr int kVec = 16 / sizeof(typename Cvt<T>::Raw);
    if (vec && rotate)
      rope_and_cache_kernel<T, kVec, true><<<grid, kRopeThreads, 0, s>>>(p);
    else if (vec)
      rope_and_cache_kernel<T, kVec, false><<<grid, kRopeThreads, 0, s>>>(p);
    else if (rotate)
      rope_and_cache_kernel<T, 1, true><<<grid, kRopeThreads, 0, s>>>(p);
    else
      rope_and_cache_kernel<T, 1, false><<<grid, kRopeThreads, 0, s>>>(p);
    return static_cast<int>(peGetLastError());
  });
}
