// Recurrent-state kernels of Mamba2 layers: causal_conv1d_update (decode / verify),
// causal_conv1d_fn (prefill, varlen) and selective_state_update (multi-token, slot per token).
// Semantics in ssm_state.h (reference: pyengine/ops/ssm_reference.py). All arithmetic in fp32.
//
// conv kernels: one thread per (row, channel); the window lives in registers, the state line is
// read (at offset a - 1) before it is rewritten, and no two threads touch the same element.
// selective_state_update: one block per (row, head, 4 head-dim rows); 32 lanes per head-dim row,
// each lane owning state_size / 32 state entries in registers across the row's tokens; the output
// dot product is a 32-lane butterfly reduction (fine on 64-wide AMD wavefronts: masks < 32).
#include "hip_compat.h"
#include "ssm_state.h"

namespace {

constexpr int kConvThreads = 128;
constexpr int kLanes = 32;
constexpr int kRowsPerBlock = 4;
constexpr int kPerLane = kSsmMaxStateSize / kLanes;

template <typename T>
struct Io;
template <>
struct Io<float> {
  static PE_DEVICE float ld(const float* p) { return *p; }
  static PE_DEVICE void st(float* p, float v) { *p = v; }
};
template <>
struct Io<pe_half> {
  static PE_DEVICE float ld(const pe_half* p) { return __half2float(*p); }
  static PE_DEVICE void st(pe_half* p, float v) { *p = __float2half_rn(v); }
};
template <>
struct Io<pe_bf16> {
  static PE_DEVICE float ld(const pe_bf16* p) { return pe_bf16_bits_to_float(p->x); }
  static PE_DEVICE void st(pe_bf16* p, float v) { p->x = pe_float_to_bf16_bits(v); }
};

PE_DEVICE float silu(float v) { return v / (1.f + __expf(-v)); }

template <typename T>
__global__ void __launch_bounds__(kConvThreads) conv1d_update_kernel(CausalConv1dParams p) {
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
  const int W = p.width;
  const int off = max(p.num_accepted[n], 1) - 1;
  T* state = static_cast<T*>(p.conv_state) + (int64_t)line * p.state_rows * p.dim + c;
  float w[kSsmMaxConvWidth];
  float buf[kSsmMaxConvWidth - 1 + kSsmMaxTokens];
#pragma unroll
  for (int j = 0; j < kSsmMaxConvWidth; ++j)
    w[j] = j < W ? Io<T>::ld(static_cast<const T*>(p.weight) + (int64_t)c * W + j) : 0.f;
  const float bias = p.bias ? Io<T>::ld(static_cast<const T*>(p.bias) + c) : 0.f;
  for (int j = 0; j < W - 1; ++j) buf[j] = Io<T>::ld(state + (int64_t)(off + j) * p.dim);
  for (int t = 0; t < num; ++t) buf[W - 1 + t] = Io<T>::ld(x + (s0 + t) * p.x_stride_token + c);
  for (int t = 0; t < num; ++t) {
    float acc = bias;
    for (int j = 0; j < W; ++j) acc += w[j] * buf[t + j];
    Io<T>::st(y + (s0 + t) * p.y_stride_token + c, p.silu ? silu(acc) : acc);
  }
  // the shifted window: rows off+1 .. off+W-2 of the old state, then the T inputs
  for (int r = 0; r < W - 2 + num; ++r) Io<T>::st(state + (int64_t)r * p.dim, buf[r + 1]);
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
    float acc = bias;
#pragma unroll
    for (int j = 0; j < kSsmMaxConvWidth; ++j) acc += j < W ? w[j] * win[j] : 0.f;
    Io<T>::st(y + (s0 + t) * p.y_stride_token + c, p.silu ? silu(acc) : acc);
#pragma unroll
    for (int j = 0; j < kSsmMaxConvWidth - 1; ++j)
      if (j < W - 1) win[j] = win[j + 1];
  }
  for (int j = 0; j < W - 1; ++j) Io<T>::st(state + (int64_t)j * p.dim, win[j]);
}

template <typename T>
__global__ void __launch_bounds__(kLanes * kRowsPerBlock) selective_state_update_kernel(SelectiveStateUpdateParams p) {
  const int lane = threadIdx.x % kLanes;
  const int pr = blockIdx.x * kRowsPerBlock + threadIdx.x / kLanes;  // head-dim row
  const int h = blockIdx.y, n = blockIdx.z;
  if (pr >= p.head_dim) return;  // a whole 32-lane group leaves together
  const int H = p.num_heads, P = p.head_dim, N = p.state_size;
  const int s0 = p.query_start_loc[n], num = p.query_start_loc[n + 1] - s0;
  const int32_t* idx = p.state_idx + (int64_t)n * p.slots_per_row;
  T* out = static_cast<T*>(p.out);
  if (idx[0] < 0) {
    if (lane == 0)
      for (int t = 0; t < num; ++t) Io<T>::st(out + ((int64_t)(s0 + t) * H + h) * P + pr, 0.f);
    return;
  }
  const int src = idx[max(p.num_accepted[n], 1) - 1];
  const int64_t head_off = ((int64_t)h * P + pr) * N;
  const int64_t slot_elems = (int64_t)H * P * N;
  float s[kPerLane];
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int k = lane + i * kLanes;
    s[i] = (src >= 0 && k < N) ? p.state[src * slot_elems + head_off + k] : 0.f;
  }
  const int g = h / (H / p.num_groups);
  const float a_h = p.A[h];
  const float d_h = p.D ? p.D[h] : 0.f;
  const float bias = p.dt_bias ? p.dt_bias[h] : 0.f;
  const T* x = static_cast<const T*>(p.x);
  const T* B = static_cast<const T*>(p.B);
  const T* C = static_cast<const T*>(p.C);
  for (int t = 0; t < num; ++t) {
    const int64_t tok = s0 + t;
    float d = Io<T>::ld(static_cast<const T*>(p.dt) + tok * p.dt_stride_token + h) + bias;
    if (p.dt_softplus) d = d > 20.f ? d : log1pf(expf(d));
    d = fminf(fmaxf(d, p.dt_min), p.dt_max);
    const float decay = expf(a_h * d);
    const float xv = Io<T>::ld(x + tok * p.x_stride_token + (int64_t)h * P + pr);
    const T* b_t = B + tok * p.B_stride_token + (int64_t)g * N;
    const T* c_t = C + tok * p.C_stride_token + (int64_t)g * N;
    const int dst = idx[t];
    float partial = 0.f;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int k = lane + i * kLanes;
      if (k < N) {
        s[i] = s[i] * decay + d * Io<T>::ld(b_t + k) * xv;
        partial += s[i] * Io<T>::ld(c_t + k);
        if (dst >= 0) p.state[dst * slot_elems + head_off + k] = s[i];
      }
    }
#pragma unroll
    for (int m = kLanes / 2; m > 0; m /= 2) partial += pe_shfl_xor(partial, m);
    if (lane == 0) {
      float yv = partial + d_h * xv;
      if (p.z) {
        const float zv = Io<T>::ld(static_cast<const T*>(p.z) + tok * p.z_stride_token + (int64_t)h * P + pr);
        yv *= silu(zv);
      }
      Io<T>::st(out + (tok * H + h) * P + pr, yv);
    }
  }
}

template <template <typename> class Launch, typename Params>
int dispatch(const Params& p, void* stream) {
  switch (p.dtype) {
    case PE_FLOAT32: return Launch<float>::run(p, static_cast<peStream_t>(stream));
    case PE_FLOAT16: return Launch<pe_half>::run(p, static_cast<peStream_t>(stream));
    case PE_BFLOAT16: return Launch<pe_bf16>::run(p, static_cast<peStream_t>(stream));
    default: return -1;
  }
}

template <typename T>
struct ConvUpdate {
  static int run(const CausalConv1dParams& p, peStream_t s) {
    const dim3 grid((p.dim + kConvThreads - 1) / kConvThreads, p.num_rows);
    conv1d_update_kernel<T><<<grid, kConvThreads, 0, s>>>(p);
    return static_cast<int>(peGetLastError());
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

template <typename T>
struct SsmUpdate {
  static int run(const SelectiveStateUpdateParams& p, peStream_t s) {
    const dim3 grid((p.head_dim + kRowsPerBlock - 1) / kRowsPerBlock, p.num_heads, p.num_rows);
    selective_state_update_kernel<T><<<grid, kLanes * kRowsPerBlock, 0, s>>>(p);
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

int launch_selective_state_update(const SelectiveStateUpdateParams& p, void* stream) {
  if (p.num_rows == 0) return 0;
  if (p.state_size <= 0 || p.state_size > kSsmMaxStateSize || p.num_groups <= 0 ||
      p.num_heads % p.num_groups != 0 || p.head_dim <= 0 || p.slots_per_row > kSsmMaxTokens)
    return -1;
  return dispatch<SsmUpdate>(p, stream);
}
