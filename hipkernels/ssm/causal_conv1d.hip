// Causal conv1d kernels of Mamba2 layers: causal_conv1d_update (decode / verify) and
// causal_conv1d_fn (prefill, varlen). Semantics in ssm_state.h (reference:
// pyengine/ops/reference/ssm.py). All arithmetic in fp32.
//
// One thread per (row, channel) (the update: per row and 4 channels, see
// conv1d_update_kernel); the window lives in registers, the state line is read (at offset a - 1)
// before it is rewritten, and no two threads touch the same element.
#include "common/hip_compat.h"
#include "ssm/ssm_state.h"
#include "ssm/ssm_vec.h"

namespace {

using namespace pe_ssm;

constexpr int kConvThreads = 128;
// conv update: threads per block, bytes of channels per access (4 bf16 channels per thread), tokens
// per load chunk. Measured on the H100 at conv dim 5120, bf16, batch 1..256, k = 0 and 3 (graph
// timing as bench_ssm.py, 2026-11-22, docs/kernels/ssm.md): 8-byte accesses beat 16-byte ones
// (batch 64, k = 3: 4.24 vs 4.75 us; batch 1, k = 3: 2.34 vs 2.75 us: the thread's arithmetic is
// on the critical path of a one-wave grid, and 16 bytes double it per thread); 128-thread blocks
// match or beat 64 from batch 64 on (k = 0, batch 64: 2.82 vs 3.04 us; batch 128: 4.17 vs 4.49)
// and lose at most 0.08 us at batch 1..16; 256 and 512 are slower (batch 64: 3.0 and 4.2 us).
// Several rows per thread (the weights loaded once for them) was slower at every batch but
// k = 3 batch 256: batch 64, k = 0: 2.97 us with two rows (4.8 with four, IEEE division), the
// per-thread arithmetic again.
constexpr int kConvUpdateThreads = 128;
constexpr int kConvVecBytes = 8;
constexpr int kConvTokenChunk = 4;

// One thread per (row, V channels), V * sizeof(T) = kConvVecBytes where the layout allows. Every
// load a thread needs is issued before the first value is used: the row metadata, the weights (W
// accesses of V elements: the [V, W] weight block is contiguous), the bias, the W - 1 history
// rows and the first TC inputs. Each history row is read once; the shifted window is written from
// registers. Inputs are loaded TC tokens at a time, before any store of that chunk: the stores
// could alias x as far as the compiler knows, so a load placed after a store waits a whole round
// trip (one per token of a verify row before this was chunked). The thread owns its channels, so
// reading the old window before rewriting it needs no synchronisation.
// KW: compile-time width bound; EXACT: W == KW (Mamba2's W = 4), else taps below K - W are zero.
// ONE: no row has more than TC tokens (state_rows - W + 2 <= TC, i.e. k <= 3), so there is no
// chunk loop: fewer instructions and 64 registers instead of 71 (8 blocks per multiprocessor
// instead of 7); H100, batch 128 / 256, k = 0: 3.64 -> 3.25 / 5.72 -> 5.17 us (docs/kernels/ssm.md).
// A one-token kernel for k = 0 (40 registers, 30% fewer instructions) was faster still at batch 128
// and 256 but slower at 64 (2.65 vs 2.47 us), not kept.
// The window is right-aligned in registers (indices fixed at compile time): full[0 .. K - 2] is
// the history, full[K - 1 + tt] the chunk's token tt; output tt uses full[tt .. tt + K - 1] with
// the weights right-aligned the same way, accumulated in the same order as the reference loop.
// (__launch_bounds__ with an explicit minimum of one block per SM is the build that was measured;
// ptxas allocates registers differently without it, e.g. 64 instead of 78 for bf16, not measured.)
template <typename T, int V, int KW, bool EXACT, bool ONE, int THREADS>
__global__ void __launch_bounds__(THREADS, 1) conv1d_update_kernel(CausalConv1dParams p) {
  using Vec = ChanVec<T, V>;
  constexpr int K = KW;
  constexpr int TC = kConvTokenChunk;
  const int n = blockIdx.y;
  const int c = (blockIdx.x * THREADS + threadIdx.x) * V;
  // Programmatic dependent launch (see launch_conv_update): a next kernel launched with it may be
  // scheduled now, and this one reads nothing (weights included: the wrapper may have just
  // converted them) before the kernel ahead of it in the stream has finished.
  pe_pdl_launch_dependents();
  if (c >= p.dim) return;
  pe_pdl_wait();
  // Row metadata first: every state and input address waits on it.
  const int s0 = p.query_start_loc[n], num = p.query_start_loc[n + 1] - s0;
  const int line = p.state_idx[(int64_t)n * p.slots_per_row];
  const int acc_n = p.num_accepted[n];
  const int W = EXACT ? KW : p.width;
  // Weights, bias and window stay in registers as loaded (16-bit types packed two per register,
  // half the registers of floats) and are converted where used. wr[i * K + m]: channel i, tap m
  // (right-aligned: taps below K - W are zero), the [dim, W] layout itself when EXACT.
  alignas(16) T wr[V * K];
  alignas(16) T br[V];
  const T* wp = static_cast<const T*>(p.weight);
  if constexpr (EXACT) {
#pragma unroll
    for (int q = 0; q < K; ++q) Vec::ld_raw(wp + (int64_t)c * K + q * V, wr + q * V);
  } else {
#pragma unroll
    for (int i = 0; i < V; ++i)
#pragma unroll
      for (int m = 0; m < K; ++m) {
        const int j = m - (K - W);
        if (j >= 0) wr[i * K + m] = wp[(int64_t)(c + i) * W + j];
        else Io<T>::st(wr + i * K + m, 0.f);
      }
  }
  if (p.bias) {
    Vec::ld_raw(static_cast<const T*>(p.bias) + c, br);
  } else {
#pragma unroll
    for (int i = 0; i < V; ++i) Io<T>::st(br + i, 0.f);
  }
  // the row's first input and output (one 64-bit address each; tokens are strides from there)
  const int64_t xs = p.x_stride_token, ys = p.y_stride_token, ds = p.dim;
  const T* x = static_cast<const T*>(p.x) + (int64_t)s0 * xs + c;
  T* y = static_cast<T*>(p.y) + (int64_t)s0 * ys + c;
  // No branch before the window's loads in the source: with the PAD / empty-row returns first,
  // the compiler placed the num_accepted load behind them, so the window's loads waited for a
  // second dependent round trip after the metadata one. Now num_accepted goes out with the other
  // metadata (ptxas still places the state and weight loads after the PAD branch, which waits for
  // the same metadata). A PAD row reads the weights instead of a state line (W - 1 rows of dim from
  // the start of the [dim, W] weights: in bounds) and discards them. Measured with 128-thread
  // blocks: within 0.07 us at k = 0 and below batch 128; k = 3, batch 128 / 256: 6.59 -> 6.41 /
  // 15.5 -> 14.1 us.
  const int off = max(acc_n, 1) - 1;
  T* state = static_cast<T*>(p.conv_state) + (int64_t)line * p.state_rows * ds + c;
  const T* hist = line >= 0 ? state + (int64_t)off * ds : wp + c;
  alignas(16) T full[K - 1 + TC][V];
#pragma unroll
  for (int m = 0; m < K - 1; ++m) {
    const int j = m - (K - W);  // history row of the old window
    if (j >= 0) {
      Vec::ld_raw(hist + j * ds, full[m]);
    } else {
#pragma unroll
      for (int i = 0; i < V; ++i) Io<T>::st(&full[m][i], 0.f);
    }
  }
#pragma unroll
  for (int tt = 0; tt < TC; ++tt)
    if (tt < num) Vec::ld_raw(x + tt * xs, full[K - 1 + tt]);
  if (line < 0) {
    const float zero[V] = {};
    for (int t = 0; t < num; ++t) Vec::st(y + t * ys, zero);
    return;
  }
  if (num <= 0) return;  // a row without tokens leaves its window as it is (as the reference does)
  // the shifted window starts with rows off+1 .. off+W-2 of the old state (old row j -> new j-1)
#pragma unroll
  for (int m = 0; m < K - 1; ++m) {
    const int j = m - (K - W);
    if (j >= 1) Vec::st_raw(state + (j - 1) * ds, full[m]);
  }
  T* st_in = state + (W - 2) * ds;  // where the inputs go, one row per token
  for (int t0 = 0; t0 < num; t0 += TC) {
    if (!ONE && t0 > 0) {  // next chunk (rows of more than TC tokens): the last K - 1 values are its history
#pragma unroll
      for (int m = 0; m < K - 1; ++m)
#pragma unroll
        for (int i = 0; i < V; ++i) full[m][i] = full[m + TC][i];
#pragma unroll
      for (int tt = 0; tt < TC; ++tt)
        if (t0 + tt < num) Vec::ld_raw(x + (t0 + tt) * xs, full[K - 1 + tt]);
    }
#pragma unroll
    for (int tt = 0; tt < TC; ++tt) {
      if (t0 + tt < num) {
        float acc[V];
#pragma unroll
        for (int i = 0; i < V; ++i) {
          acc[i] = Io<T>::ld(br + i);
#pragma unroll
          for (int m = 0; m < K; ++m)  // the W real taps, oldest first: conv1d_fn_kernel's operations
            if (EXACT || m >= K - W) acc[i] = fmaf(Io<T>::ld(wr + i * K + m), Io<T>::ld(&full[tt + m][i]), acc[i]);
          if (p.silu) acc[i] = silu_fast(acc[i]);
        }
        Vec::st_packed(y + (t0 + tt) * ys, acc);
        Vec::st_raw(st_in + (t0 + tt) * ds, full[K - 1 + tt]);  // ... then the T inputs
      }
    }
    if (ONE) break;
  }
}

template <typename T>
__global__ void __launch_bounds__(kConvThreads) conv1d_fn_kernel(CausalConv1dParams p) {
  const int n = blockIdx.y;
  const int c = blockIdx.x * kConvThreads + threadIdx.x;
  if (c >= p.dim) return;
  const int s0 = p.query_start_loc[n], num = p.query_start_loc[n + 1] - s0;
  const T* x = static_cast<const T*>(p.x);
  T* y = static_cast<T*>(p.y);
  const int line = p.state_idx[(int64_t)n * p.slots_per_row];
  if (line < 0) {
    for (int t = 0; t < num; ++t) Io<T>::st(y + (s0 + t) * p.y_stride_token + c, 0.f);
    return;
  }
  if (num == 0) return;
  const int W = p.width;
  const int off = max(p.num_accepted[n], 1) - 1;
  const bool init = p.has_initial_state == nullptr || p.has_initial_state[n];
  T* state = static_cast<T*>(p.conv_state) + (int64_t)line * p.state_rows * p.dim + c;
  float w[kSsmMaxConvWidth], win[kSsmMaxConvWidth];
#pragma unroll
  for (int j = 0; j < kSsmMaxConvWidth; ++j) {
    w[j] = j < W ? Io<T>::ld(static_cast<const T*>(p.weight) + (int64_t)c * W + j) : 0.f;
    win[j] = (init && j < W - 1) ? Io<T>::ld(state + (int64_t)(off + j) * p.dim) : 0.f;
  }
  const float bias = p.bias ? Io<T>::ld(static_cast<const T*>(p.bias) + c) : 0.f;
  for (int t = 0; t < num; ++t) {
    win[W - 1] = Io<T>::ld(x + (s0 + t) * p.x_stride_token + c);
    // bias, then one fmaf per tap oldest first, then silu_fast: bit for bit what the decode kernel
    // computes, so a token's output is the same whichever of the two its step ran (a one-token
    // prefill chunk after an earlier chunk is a decode row)
    float acc = bias;
#pragma unroll
    for (int j = 0; j < kSsmMaxConvWidth; ++j)
      if (j < W) acc = fmaf(w[j], win[j], acc);
    Io<T>::st(y + (s0 + t) * p.y_stride_token + c, p.silu ? silu_fast(acc) : acc);
#pragma unroll
    for (int j = 0; j < kSsmMaxConvWidth - 1; ++j)
      if (j < W - 1) win[j] = win[j + 1];
  }
  for (int j = 0; j < W - 1; ++j) Io<T>::st(state + (int64_t)j * p.dim, win[j]);
}

// conv1d_update_kernel's launch. With p.pdl (CUDA) it is a programmatic dependent launch: the
// kernel may be scheduled while the kernel ahead of it in the stream finishes, and its
// pe_pdl_wait() (before any load) holds it until that kernel's writes are visible; under hipcc, and
// without p.pdl, an ordinary launch.
template <typename T, int V, int KW, bool EXACT, bool ONE, int THREADS>
int launch_conv_update(const CausalConv1dParams& p, peStream_t s) {
  const int threads = (p.dim + V - 1) / V;
  const dim3 grid((threads + THREADS - 1) / THREADS, p.num_rows);
  const peError_t rc = pe_launch(conv1d_update_kernel<T, V, KW, EXACT, ONE, THREADS>, grid, dim3(THREADS), 0, s, p.pdl, p);
  return rc != peSuccess ? (int)rc : (int)peGetLastError();
}

template <typename T>
struct ConvUpdate {
  template <int V>
  static int launch_width(const CausalConv1dParams& p, peStream_t s) {
    constexpr int NT = kConvUpdateThreads;
    const int max_tokens = p.state_rows - p.width + 2;  // per row
    if (p.width == 4) {  // Mamba2's width: no chunk loop where the rows allow it (vector path)
      if (V > 1 && max_tokens <= kConvTokenChunk) return launch_conv_update<T, V, 4, true, true, NT>(p, s);
      return launch_conv_update<T, V, 4, true, false, NT>(p, s);
    }
    if (p.width < 4) return launch_conv_update<T, V, 4, false, false, NT>(p, s);
    return launch_conv_update<T, V, kSsmMaxConvWidth, false, false, NT>(p, s);
  }
  static int run(const CausalConv1dParams& p, peStream_t s) {
    constexpr int kVec = kConvVecBytes / sizeof(T);
    const uintptr_t align = kVec * sizeof(T);
    auto aligned = [&](const void* q) { return reinterpret_cast<uintptr_t>(q) % align == 0; };
    const bool vec = p.dim % kVec == 0 && p.x_stride_token % kVec == 0 && p.y_stride_token % kVec == 0 &&
                     aligned(p.x) && aligned(p.y) && aligned(p.conv_state) && aligned(p.weight) &&
                     (p.bias == nullptr || aligned(p.bias));
    return vec ? launch_width<kVec>(p, s) : launch_width<1>(p, s);
  }
};

template <typename T>
struct ConvFn {
  static int run(const CausalConv1dParams& p, peStream_t s) {
    const dim3 grid((p.dim + kConvThreads - 1) / kConvThreads, p.num_rows);
    conv1d_fn_kernel<T><<<grid, kConvThreads, 0, s>>>(p);
    return static_cast<int>(peGetLastError());
  }
};

bool conv_ok(const CausalConv1dParams& p) {
  return p.width >= 2 && p.width <= kSsmMaxConvWidth && p.dim > 0 && p.state_rows >= p.width - 1;
}

}  // namespace

int launch_causal_conv1d_update(const CausalConv1dParams& p, void* stream) {
  if (p.num_rows == 0) return 0;
  // T <= 1 + k tokens per row, and the window must fit: W - 2 + T <= state_rows (checked by the wrapper).
  if (!conv_ok(p) || p.state_rows - p.width + 2 > kSsmMaxTokens) return -1;
  return dispatch<ConvUpdate>(p, stream);
}

int launch_causal_conv1d_fn(const CausalConv1dParams& p, void* stream) {
  if (p.num_rows == 0) return 0;
  if (!conv_ok(p)) return -1;
  return dispatch<ConvFn>(p, stream);
}
