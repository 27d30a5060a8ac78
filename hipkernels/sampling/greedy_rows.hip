// greedy_rows: one block per logits row; each thread scans a strided share of the row (16-byte loads
// where the row allows them), then the block combines the threads' (max, first index, first NaN,
// any non-finite) by warp shuffles and shared memory. Ties keep the lower index and a NaN beats
// every number, as torch.argmax does; every step is a comparison, so the result is exact.
#include "common/hip_compat.h"
#include "sampling/greedy_rows.h"

namespace {

constexpr int kThreads = 512;
constexpr int64_t kNone = INT64_MAX;  // no index yet

struct Best {
  float value;       // the largest number seen (NaN excluded)
  int64_t index;     // its first index, kNone: none
  int64_t nan;       // the first NaN's index, kNone: none
  bool non_finite;   // a NaN or an infinity seen
};

PE_DEVICE void take(Best& b, float v, int64_t i) {
  if (v != v) {
    b.nan = i < b.nan ? i : b.nan;
    b.non_finite = true;
    return;
  }
  b.non_finite = b.non_finite || isinf(v);
  if (b.index == kNone || v > b.value || (v == b.value && i < b.index)) {
    b.value = v;
    b.index = i;
  }
}

PE_DEVICE void merge(Best& b, const Best& o) {
  b.nan = o.nan < b.nan ? o.nan : b.nan;
  b.non_finite = b.non_finite || o.non_finite;
  if (o.index != kNone && (b.index == kNone || o.value > b.value || (o.value == b.value && o.index < b.index))) {
    b.value = o.value;
    b.index = o.index;
  }
}

PE_DEVICE Best shuffle(const Best& b, int mask) {
  Best o;
  o.value = pe_shfl_xor(b.value, mask);
  o.index = pe_shfl_xor(b.index, mask);
  o.nan = pe_shfl_xor(b.nan, mask);
  o.non_finite = pe_shfl_xor((int)b.non_finite, mask) != 0;
  return o;
}

template <bool kVec>
__global__ void __launch_bounds__(kThreads) greedy_rows_kernel(GreedyRowsParams p) {
  const int64_t row = blockIdx.x;
  const float* x = p.logits + row * p.row_stride;
  Best b{0.f, kNone, kNone, false};
  if constexpr (kVec) {
    const float4* x4 = reinterpret_cast<const float4*>(x);
    for (int64_t c = threadIdx.x; c < p.vocab / 4; c += kThreads) {
      const float4 v = x4[c];
      take(b, v.x, 4 * c);
      take(b, v.y, 4 * c + 1);
      take(b, v.z, 4 * c + 2);
      take(b, v.w, 4 * c + 3);
    }
  } else {
    for (int64_t c = threadIdx.x; c < p.vocab; c += kThreads) take(b, x[c], c);
  }
#pragma unroll
  for (int o = PE_WARP_SIZE / 2; o > 0; o >>= 1) merge(b, shuffle(b, o));
  __shared__ Best partial[kThreads / PE_WARP_SIZE];
  const int warp = threadIdx.x / PE_WARP_SIZE;
  if (threadIdx.x % PE_WARP_SIZE == 0) partial[warp] = b;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kThreads / PE_WARP_SIZE; ++w) merge(b, partial[w]);
    p.out[row] = b.nan != kNone ? b.nan : b.index;
    p.out[p.num_rows + row] = b.non_finite ? 0 : 1;
  }
}

}  // namespace

int launch_greedy_rows(const GreedyRowsParams& p, void* stream) {
  if (p.num_rows == 0) return 0;
  if (p.vocab < 1) return -1;
  const bool vec = p.vocab % 4 == 0 && p.row_stride % 4 == 0 && reinterpret_cast<uintptr_t>(p.logits) % 16 == 0;
  const peStream_t s = static_cast<peStream_t>(stream);
  if (vec)
    greedy_rows_kernel<true><<<dim3((unsigned)p.num_rows), kThreads, 0, s>>>(p);
  else
    greedy_rows_kernel<false><<<dim3((unsigned)p.num_rows), kThreads, 0, s>>>(p);
  return static_cast<int>(peGetLastError());
}
