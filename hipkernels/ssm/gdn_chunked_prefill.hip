// Chunk-wise Gated DeltaNet prefill (semantics in gdn_chunked_prefill.h, math in
// docs/kernels/gdn_prefill.md; its PyTorch emulation, step for step, is
// tests/test_gdn_chunked_emulation.py). fp32 SIMT arithmetic throughout.
//
// One block per (row, value head, tile of kTileV value columns of S), walking the row's chunks in
// order with the tile S[:, tile] (K x kTileV) in shared memory. Per chunk of C tokens, from S0:
//   1. k, q l2-normalised (q scaled), g, beta into shared memory; rows past the row's end are zero
//   2. cum_t = g_0 + ... + g_t (each thread t its own running sum); the Gram matrices k_t.k_s and
//      q_t.k_s; S0^T k_t and S0^T q_t for the tile's columns
//   3. A[t][s] = beta_t (k_t.k_s) e^{cum_t - cum_s} (s < t) and M[t][s] = (q_t.k_s) e^{cum_t - cum_s}
//      (s <= t), written over q; rhs_t = beta_t (v_t - e^{cum_t} S0^T k_t)
//   4. (I + A) U = rhs by forward substitution, token after token (8 lanes per value column)
//   5. o_t = e^{cum_t} S0^T q_t + sum_{s <= t} M[t][s] u_s
//   6. S = e^{cum_last} S0 + sum_s e^{cum_last - cum_s} k_s u_s^T
// Every exponent is <= 0 (decays only multiply down). Each block recomputes the chunk's A and M for
// its head: cheaper than a second kernel and its round trip through memory. A block's arithmetic
// depends on its row alone, so a row gives the same bits whatever else is in the batch.
#include "common/hip_compat.h"
#include "ssm/gdn_chunked_prefill.h"

namespace {

#if defined(PE_HIP)
constexpr int kChunk = 32;  // gfx90a: A, M, k, q and the tile in 64 KB of LDS
constexpr size_t kMaxSmemBytes = 64 * 1024;
#else
constexpr int kChunk = 64;
constexpr size_t kMaxSmemBytes = 227 * 1024;
#endif
constexpr int kTileV = 32;   // value columns per block
constexpr int kThreads = 256;
constexpr int kLanes = 32;   // lane groups of 32 (an AMD wavefront of 64 holds two; masks stay < 32)
constexpr int kGroups = kThreads / kLanes;
constexpr int kRowsPerGroup = kChunk / kGroups;  // steps 1, 2, 5: tokens grp + kGroups * r
constexpr int kGram = kChunk / 16;               // step 2: Gram rows gi + 16 i, columns gj + 16 j
constexpr int kSolveLanes = 8;                   // step 4: lanes per value column
constexpr int kSolveRegs = kChunk / kSolveLanes; // tokens sub + 8 j of the lane
constexpr int kTileP = kTileV + 1;               // padded: a column of the tile is conflict-free
constexpr int kChunkP = kChunk + 4;              // k, q, A, M rows padded by 4: 16-byte reads
constexpr int kQuadPasses = 4;                   // step 6: 4-key quads per thread and pass
static_assert(kTileV * kSolveLanes == kThreads, "the solve gives each value column 8 lanes");
static_assert(kChunk % 16 == 0 && kChunk <= kThreads, "chunk size");

PE_DEVICE float group_sum(float x) {  // over the 32-lane group
#pragma unroll
  for (int m = kLanes / 2; m > 0; m /= 2) x += pe_shfl_xor(x, m);
  return x;
}

// Shared memory, in floats: k [C][K+4]; q [C][K+4], over which A [C][C+1] and M [C][C+1] go once
// the Gram step has read q; the tile S [K][kTileP]; U [C][kTileP]; g, beta, cum, decay-to-end [C].
__host__ __device__ inline size_t region_floats(int K) {
  const size_t q = (size_t)kChunk * (K + 4), am = 2 * (size_t)kChunk * kChunkP;
  return q > am ? q : am;
}

size_t smem_bytes(int K) {
  return sizeof(float) * ((size_t)kChunk * (K + 4) + region_floats(K) + (size_t)K * kTileP +
                          (size_t)kChunk * kTileP + 4 * kChunk);
}

template <typename T>
__global__ void __launch_bounds__(kThreads) gdn_chunked_prefill_kernel(GdnChunkedPrefillParams p) {
  extern __shared__ float4 smem4[];  // float4: 16-byte alignment
  float* smem = reinterpret_cast<float*>(smem4);
  const int tid = threadIdx.x, lane = tid % kLanes, grp = tid / kLanes;
  const int v0 = blockIdx.x * kTileV, hv = blockIdx.y, n = blockIdx.z;
  const int K = p.key_dim, V = p.value_dim, HV = p.num_v_heads, KP = K + 4;
  const int cols = min(kTileV, V - v0);
  const int s0 = p.query_start_loc[n], num = p.query_start_loc[n + 1] - s0;
  const int slot = p.state_idx[(int64_t)n * p.state_idx_stride];
  T* out = static_cast<T*>(p.out);
  if (num <= 0) return;
  if (slot < 0) {  // PAD row: zero output, no state
    for (int i = tid; i < num * cols; i += kThreads)
      Io<T>::st(out + ((int64_t)(s0 + i / cols) * HV + hv) * V + v0 + i % cols, 0.f);
    return;
  }
  float* ks = smem;
  float* qs = ks + kChunk * KP;
  float* am = qs;                       // A, over q after step 2
  float* mm = qs + kChunk * kChunkP;    // M, likewise
  float* ss = qs + region_floats(K);    // S[k][c] of the tile
  float* us = ss + K * kTileP;          // rhs, then U
  float* gs = us + kChunk * kTileP;
  float* bs = gs + kChunk;
  float* cum = bs + kChunk;
  float* to_end = cum + kChunk;         // e^{cum_last - cum_s}

  const bool init = p.has_initial_state == nullptr || p.has_initial_state[n];
  float* st = p.state + ((int64_t)slot * HV + hv) * V * K + (int64_t)v0 * K;  // value row v0 of head hv
  for (int i = tid; i < K * kTileV; i += kThreads) {
    const int c = i / K, kk = i % K;
    ss[kk * kTileP + c] = (init && c < cols) ? st[(int64_t)c * K + kk] : 0.f;
  }
  const int hk = hv / (HV / p.num_k_heads);
  const T* qg = static_cast<const T*>(p.q) + (int64_t)hk * K;
  const T* kg = static_cast<const T*>(p.k) + (int64_t)hk * K;
  const T* vg = static_cast<const T*>(p.v) + (int64_t)hv * V + v0;
  const int gi = tid / 16, gj = tid % 16;                         // step 2's Gram micro-tile
  const int sc = tid / kSolveLanes, sub = tid % kSolveLanes;      // step 4's column and lane

  for (int c0 = 0; c0 < num; c0 += kChunk) {
    const int len = min(kChunk, num - c0);
    const int64_t tok0 = s0 + c0;
    // 1. the chunk's k, q (normalised; q scaled as the recurrence does), g, beta; zeros past len
    if (tid < kChunk) {
      gs[tid] = tid < len ? p.g[(tok0 + tid) * HV + hv] : 0.f;
      bs[tid] = tid < len ? p.beta[(tok0 + tid) * HV + hv] : 0.f;
    }
    for (int r = 0; r < kRowsPerGroup; ++r) {
      const int t = grp + kGroups * r;
      float ksq = 0.f, qsq = 0.f;
      for (int kk = lane; kk < K; kk += kLanes) {
        const float a = t < len ? Io<T>::ld(kg + (tok0 + t) * p.k_stride_token + kk) : 0.f;
        const float b = t < len ? Io<T>::ld(qg + (tok0 + t) * p.q_stride_token + kk) : 0.f;
        ks[t * KP + kk] = a, qs[t * KP + kk] = b;
        ksq += a * a, qsq += b * b;
      }
      const float kn = p.l2norm ? rsqrtf(group_sum(ksq) + 1e-6f) : 1.f;
      const float qn = (p.l2norm ? rsqrtf(group_sum(qsq) + 1e-6f) : 1.f) * p.scale;
      for (int kk = lane; kk < K; kk += kLanes) ks[t * KP + kk] *= kn, qs[t * KP + kk] *= qn;
    }
    __syncthreads();

    // 2. cumulative log-decays; Gram matrices; S0^T k_t and S0^T q_t for this tile
    if (tid < kChunk) {
      float run = 0.f;
      for (int s = 0; s <= tid; ++s) run += gs[s];
      cum[tid] = run;
    }
    // Entry (i, j) is t - s = gi - gj + 16 (i - j): j > i is above the diagonal, never needed.
    float gkk[kGram][kGram] = {}, gqk[kGram][kGram] = {};
    for (int kk = 0; kk < K; kk += 4) {
      float4 a[kGram], b[kGram], q[kGram];
#pragma unroll
      for (int i = 0; i < kGram; ++i) {
        a[i] = *reinterpret_cast<const float4*>(ks + (gi + 16 * i) * KP + kk);
        q[i] = *reinterpret_cast<const float4*>(qs + (gi + 16 * i) * KP + kk);
        b[i] = *reinterpret_cast<const float4*>(ks + (gj + 16 * i) * KP + kk);
      }
#pragma unroll
      for (int i = 0; i < kGram; ++i)
#pragma unroll
        for (int j = 0; j <= i; ++j) {
          gkk[i][j] += a[i].x * b[j].x + a[i].y * b[j].y + a[i].z * b[j].z + a[i].w * b[j].w;
          gqk[i][j] += q[i].x * b[j].x + q[i].y * b[j].y + q[i].z * b[j].z + q[i].w * b[j].w;
        }
    }
    float kS[kRowsPerGroup] = {}, oq[kRowsPerGroup] = {};
    for (int kk = 0; kk < K; kk += 4) {
      const float s0_ = ss[kk * kTileP + lane], s1 = ss[(kk + 1) * kTileP + lane];
      const float s2 = ss[(kk + 2) * kTileP + lane], s3 = ss[(kk + 3) * kTileP + lane];
#pragma unroll
      for (int r = 0; r < kRowsPerGroup; ++r) {
        const int t = grp + kGroups * r;
        const float4 a = *reinterpret_cast<const float4*>(ks + t * KP + kk);
        const float4 b = *reinterpret_cast<const float4*>(qs + t * KP + kk);
        kS[r] += a.x * s0_ + a.y * s1 + a.z * s2 + a.w * s3;
        oq[r] += b.x * s0_ + b.y * s1 + b.z * s2 + b.w * s3;
      }
    }
    __syncthreads();  // cum is complete; q is read: A and M may go over it

    // 3. A and M; rhs into U; the decays to the chunk's end
#pragma unroll
    for (int i = 0; i < kGram; ++i)
#pragma unroll
      for (int j = 0; j < kGram; ++j) {
        const int t = gi + 16 * i, s = gj + 16 * j;
        const float d = (j <= i && s <= t) ? expf(cum[t] - cum[s]) : 0.f;
        am[t * kChunkP + s] = (j <= i && s < t) ? bs[t] * gkk[i][j] * d : 0.f;
        mm[t * kChunkP + s] = j <= i ? gqk[i][j] * d : 0.f;
      }
#pragma unroll
    for (int r = 0; r < kRowsPerGroup; ++r) {
      const int t = grp + kGroups * r;
      const float gam = expf(cum[t]);
      const float v = (t < len && lane < cols) ? Io<T>::ld(vg + (tok0 + t) * p.v_stride_token + lane) : 0.f;
      us[t * kTileP + lane] = bs[t] * (v - gam * kS[r]);
      oq[r] *= gam;
    }
    if (tid < kChunk) to_end[tid] = expf(cum[kChunk - 1] - cum[tid]);
    __syncthreads();

    // 4. (I + A) U = rhs, token after token: lane sub of column sc keeps tokens sub + 8 j in
    // registers and adds its share of sum_{s<t} A[t][s] u_s; the 8 lanes' butterfly gives the sum
    // to token t's owner. Each lane reads and writes only its own entries of U.
    float u[kSolveRegs];
#pragma unroll
    for (int j = 0; j < kSolveRegs; ++j) u[j] = us[(sub + kSolveLanes * j) * kTileP + sc];
#pragma unroll
    for (int t = 1; t < kChunk; ++t) {
      float part = 0.f;
#pragma unroll
      for (int j = 0; j < kSolveRegs; ++j)
        if (sub + kSolveLanes * j < t) part += am[t * kChunkP + sub + kSolveLanes * j] * u[j];
#pragma unroll
      for (int m = 1; m < kSolveLanes; m *= 2) part += pe_shfl_xor(part, m);
      if (sub == t % kSolveLanes) u[t / kSolveLanes] -= part;
    }
#pragma unroll
    for (int j = 0; j < kSolveRegs; ++j) us[(sub + kSolveLanes * j) * kTileP + sc] = u[j];
    __syncthreads();

    // 5. outputs: o_t = e^{cum_t} S0^T q_t + sum_{s<=t} M[t][s] u_s (M is zero above the diagonal)
    for (int s = 0; s < kChunk; s += 4) {
      const float u0 = us[s * kTileP + lane], u1 = us[(s + 1) * kTileP + lane];
      const float u2 = us[(s + 2) * kTileP + lane], u3 = us[(s + 3) * kTileP + lane];
#pragma unroll
      for (int r = 0; r < kRowsPerGroup; ++r) {
        const float4 m = *reinterpret_cast<const float4*>(mm + (grp + kGroups * r) * kChunkP + s);
        oq[r] += m.x * u0 + m.y * u1 + m.z * u2 + m.w * u3;
      }
    }
#pragma unroll
    for (int r = 0; r < kRowsPerGroup; ++r) {
      const int t = grp + kGroups * r;
      if (t < len && lane < cols) Io<T>::st(out + ((tok0 + t) * HV + hv) * V + v0 + lane, oq[r]);
    }

    // 6. S = e^{cum_last} S0 + sum_s k_s (e^{cum_last - cum_s} u_s)^T; lane = column; the thread
    // owns the key quads grp + 8 r (keys 4 quad .. 4 quad + 3), read as one 16-byte broadcast each
    const float glast = expf(cum[kChunk - 1]);
    for (int base = grp; base < K / 4; base += kGroups * kQuadPasses) {
      float acc[kQuadPasses][4];
#pragma unroll
      for (int r = 0; r < kQuadPasses; ++r) {
        const int quad = base + kGroups * r;
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[r][e] = quad < K / 4 ? glast * ss[(4 * quad + e) * kTileP + lane] : 0.f;
      }
      for (int s = 0; s < kChunk; ++s) {
        const float w = to_end[s] * us[s * kTileP + lane];
#pragma unroll
        for (int r = 0; r < kQuadPasses; ++r) {
          const int quad = base + kGroups * r;
          if (quad < K / 4) {
            const float4 k4 = *reinterpret_cast<const float4*>(ks + s * KP + 4 * quad);
            acc[r][0] += k4.x * w, acc[r][1] += k4.y * w, acc[r][2] += k4.z * w, acc[r][3] += k4.w * w;
          }
        }
      }
#pragma unroll
      for (int r = 0; r < kQuadPasses; ++r) {
        const int quad = base + kGroups * r;
        if (quad < K / 4)
#pragma unroll
          for (int e = 0; e < 4; ++e) ss[(4 * quad + e) * kTileP + lane] = acc[r][e];
      }
    }
    __syncthreads();  // before the next chunk overwrites k, q, g, beta and reads S
  }
  for (int i = tid; i < K * kTileV; i += kThreads) {
    const int c = i / K, kk = i % K;
    if (c < cols) st[(int64_t)c * K + kk] = ss[kk * kTileP + c];
  }
}

template <typename T>
int launch(const GdnChunkedPrefillParams& p, peStream_t stream) {
  const size_t bytes = smem_bytes(p.key_dim);
  if (bytes > kMaxSmemBytes) return -1;
  const void* fn = reinterpret_cast<const void*>(&gdn_chunked_prefill_kernel<T>);
#if defined(PE_HIP)
  peError_t rc = hipFuncSetAttribute(fn, hipFuncAttributeMaxDynamicSharedMemorySize, (int)bytes);
#else
  peError_t rc = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes);
#endif
  if (rc != peSuccess) return static_cast<int>(rc);
  const dim3 grid((p.value_dim + kTileV - 1) / kTileV, p.num_v_heads, p.num_rows);
  gdn_chunked_prefill_kernel<T><<<grid, kThreads, bytes, stream>>>(p);
  return static_cast<int>(peGetLastError());
}

}  // namespace

int gdn_chunked_prefill_chunk_size() { return kChunk; }

int launch_gdn_chunked_prefill(const GdnChunkedPrefillParams& p, void* stream) {
  if (p.num_rows == 0) return 0;
  if (p.key_dim <= 0 || p.key_dim > kGdnPrefillMaxKeyDim || p.key_dim % 4 != 0 || p.value_dim <= 0 || p.num_k_heads <= 0 ||
      p.num_v_heads % p.num_k_heads != 0 || p.num_rows > 65535 || p.state_idx_stride < 1)
    return -1;
  const peStream_t s = static_cast<peStream_t>(stream);
  switch (p.dtype) {
    case PE_FLOAT32: return launch<float>(p, s);
    case PE_FLOAT16: return launch<pe_half>(p, s);
    case PE_BFLOAT16: return launch<pe_bf16>(p, s);
    default: return -1;
  }
}
