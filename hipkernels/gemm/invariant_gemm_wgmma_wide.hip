// Batch-invariant GEMM, wgmma family, 128 x 256 output tiles (contract and reduction order in
// invariant_gemm_wgmma.h; the 64 / 128 x 128 tiles and their K-split combines are in
// invariant_gemm_wgmma.hip). Above 64 rows (verify steps, prefill): a wider tile reads each k tile
// of x once per 192 / 256 columns instead of 128 and feeds the tensor cores m64n256k16 / m64n192k16
// products (H100, M = 4096: Llama-8B's gate_up 643 TFLOP/s against the 128-wide tile's 488, qkv 605
// against 505; docs/kernels/invariant_gemm.md).
#include "gemm/invariant_gemm_wgmma.h"

#include "common/hip_compat.h"

#if defined(PE_CUDA)
#include <cuda.h>

#include "common/wgmma_tile.h"
#include "gemm/tma.h"

namespace {

constexpr int kBK = 64, kGroupM = 16;

#if defined(PE_WGMMA)
#define PE_WG_REGS96 \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, " \
  "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
  "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95"
#define PE_WG_OUTS96(d) PE_WG_OUTS32(d), PE_WG_OUTS32((d + 32)), PE_WG_OUTS32((d + 64))

// acc (64 x BN, wgmma layout) += A (the warpgroup's 64 rows, k 16 kk..) * B (k rows 16 kk.., BN n;
// 64-column slabs 8 KB apart): m64n256k16 / m64n192k16, the same 16-deep step per output as the
// 128-wide tile's m64n128k16 (tests/test_invariant_gemm_gpu.py checks the bits).
template <typename T, int BN>
PE_DEVICE void product_wide(float* acc, const uint8_t* a, const uint8_t* b, int kk) {
  const uint64_t da = pe_wg::desc(a + kk * 32, 16, 1024);
  const uint64_t db = pe_wg::desc(b + kk * 16 * 128, kBK * 128, 1024);
  constexpr bool kBf16 = std::is_same<T, pe_bf16>::value;
  if constexpr (BN == 256 && kBf16)
    PE_WGMMA_ASM("m64n256k16.f32.bf16.bf16", PE_WG_REGS128, "128", "129", "130", "1", PE_WG_OUTS128(acc));
  else if constexpr (BN == 256)
    PE_WGMMA_ASM("m64n256k16.f32.f16.f16", PE_WG_REGS128, "128", "129", "130", "1", PE_WG_OUTS128(acc));
  else if constexpr (kBf16)
    PE_WGMMA_ASM("m64n192k16.f32.bf16.bf16", PE_WG_REGS96, "96", "97", "98", "1", PE_WG_OUTS96(acc));
  else
    PE_WGMMA_ASM("m64n192k16.f32.f16.f16", PE_WG_REGS96, "96", "97", "98", "1", PE_WG_OUTS96(acc));
}
#endif

// 128 x BN tiles: BN 256 for one K range; BN 192 for a block walking `splits` ranges (kSequential:
// its running total needs another BN / 2 registers, 2 x 96 fit where 2 x 128 do not). Three
// warpgroups: two consumers own 64 x BN each and the last is the producer (one lane issues the TMA
// copies). 384 threads get 168 registers each at launch; setmaxnreg hands the producer's down to 40
// and the consumers' up to 232 (2 x 128 x 232 + 128 x 40 <= 64K). The reduction order is the
// 128-wide tile's: k tiles of 64 in order, four 16-deep products each, fp32 from zero, the ranges'
// sums added in order, bias last, one rounding, each row in one 64-row wgmma. The epilogue stages
// the rounded tile in shared memory (the stages are free by then) and writes 16-byte row segments.
template <int BN>
struct WideTile {
  static constexpr int kBM = 128, kBN = BN, kThreads = 384, kConsumers = 256, kStages = BN == 256 ? 4 : 5;
  static constexpr int kABytes = kBM * kBK * 2, kBBytes = kBK * kBN * 2, kStageBytes = kABytes + kBBytes;
  static constexpr size_t kSmemBytes = 1024 + (size_t)kStages * kStageBytes + 2 * kStages * sizeof(uint64_t);
  static constexpr int kOutStride = kBN + 8;  // staged output rows, padded: conflict-free 4-byte writes
  static_assert((size_t)kBM * kOutStride * 2 <= (size_t)kStages * kStageBytes, "staged outputs fit the stages");
  static_assert(kSmemBytes <= 227 * 1024, "one block per SM");
};

template <typename T, int BN, bool kSequential>
__global__ void __launch_bounds__(384, 1)
    wgmma_wide_kernel(const __grid_constant__ CUtensorMap map_x, const __grid_constant__ CUtensorMap map_w,
                      InvariantGemmParams p, int splits) {
#if defined(PE_WGMMA) && defined(PE_TMA)
  using L = WideTile<BN>;
  constexpr int kAcc = BN / 2;
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  uint8_t* smem = smem_raw + pe_wg::align_1024(smem_raw);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + L::kStages * L::kStageBytes);
  uint64_t* empty = full + L::kStages;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int tiles_m = (p.m + L::kBM - 1) / L::kBM, tiles_n = (p.n + L::kBN - 1) / L::kBN;
  const int tile = (int)blockIdx.x;
  const int first_m = tile / (kGroupM * tiles_n) * kGroupM, in_group = tile % (kGroupM * tiles_n);
  const int group_rows = min(tiles_m - first_m, kGroupM);
  const int m0 = (first_m + in_group % group_rows) * L::kBM, n0 = in_group / group_rows * L::kBN;
  const int k_tiles = p.k / kBK;
  const auto range_begin = [&](int s) { return (int)((int64_t)k_tiles * s / splits); };

  if (tid == 0) {
    for (int s = 0; s < L::kStages; ++s) pe_tma::init(&full[s], 1), pe_tma::init(&empty[s], L::kConsumers / 32);
    pe_tma::fence_init();
  }
  __syncthreads();
  pe_pdl_launch_dependents();

  if (warp >= L::kConsumers / 32) {  // the producer warpgroup
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
    if (warp == L::kConsumers / 32 && lane == 0) {
      pe_tma::prefetch_map(&map_x), pe_tma::prefetch_map(&map_w);
      const auto load_w = [&](int t) {
        uint8_t* st = smem + (t % L::kStages) * L::kStageBytes + L::kABytes;
#pragma unroll
        for (int j = 0; j < L::kBN / 64; ++j)
          pe_tma::load_2d(st + j * kBK * 128, &map_w, &full[t % L::kStages], n0 + 64 * j, t * kBK);
      };
      const auto load_x = [&](int t) {
        pe_tma::load_2d(smem + (t % L::kStages) * L::kStageBytes, &map_x, &full[t % L::kStages], t * kBK, m0);
      };
      const int first = min(k_tiles, L::kStages);
      for (int t = 0; t < first; ++t) pe_tma::arrive_expect_tx(&full[t], L::kStageBytes), load_w(t);
      pe_pdl_wait();
      for (int t = 0; t < first; ++t) load_x(t);
      for (int t = first; t < k_tiles; ++t) {
        pe_tma::wait(&empty[t % L::kStages], (t / L::kStages - 1) & 1);
        pe_tma::arrive_expect_tx(&full[t % L::kStages], L::kStageBytes);
        load_w(t), load_x(t);
      }
    }
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
  const uint8_t* a_rows = smem + (warp / 4) * 64 * 128;  // this warpgroup's 64 rows of each x stage
  float acc[kAcc];
  float total[kSequential ? kAcc : 1];
#pragma unroll
  for (int i = 0; i < kAcc; ++i) acc[i] = 0.f;
  int range = 0, range_end = kSequential ? range_begin(1) : k_tiles;
  for (int t = 0; t < k_tiles; ++t) {
    if constexpr (kSequential) {
      while (t == range_end) {  // range `range` complete (empty ranges too): into the total, in order
        pe_tma::wgmma_wait<0>();
        pe_wg::fence_operands(acc);
#pragma unroll
        for (int i = 0; i < kAcc; ++i) total[i] = range == 0 ? acc[i] : total[i] + acc[i], acc[i] = 0.f;
        range_end = range_begin(++range + 1);
      }
    }
    const int s = t % L::kStages;
    pe_tma::wait(&full[s], (t / L::kStages) & 1);
    pe_wg::fence_operands(acc);
    pe_wg::begin();
#pragma unroll
    for (int kk = 0; kk < kBK / 16; ++kk)
      product_wide<T, BN>(acc, a_rows + s * L::kStageBytes, smem + s * L::kStageBytes + L::kABytes, kk);
    pe_wg::commit();
    pe_tma::wgmma_wait<1>();  // the previous tile's products are done: its stage is free
    pe_wg::fence_operands(acc);
    if (t > 0 && lane == 0) pe_tma::arrive(&empty[(t - 1) % L::kStages]);
  }
  pe_tma::wgmma_wait<0>();
  pe_wg::fence_operands(acc);
  if constexpr (kSequential) {
    if (range > 0) {
#pragma unroll
      for (int i = 0; i < kAcc; ++i) acc[i] = total[i] + acc[i];
    }
  }

  // Bias last, one rounding, into shared memory once both warpgroups' products have read the stages.
  const uint16_t* bias = static_cast<const uint16_t*>(p.bias);
  uint16_t* out = reinterpret_cast<uint16_t*>(smem);
  pe_tma::named_sync(1, L::kConsumers);
  const int r0 = (warp / 4) * 64 + (warp % 4) * 16 + lane / 4;
#pragma unroll
  for (int i = 0; i < L::kBN / 8; ++i) {
    const int col = 8 * i + lane % 4 * 2;
    const bool in = n0 + col < p.n;  // N % 8 == 0: col + 1 as well
    const float b0 = bias && in ? PeVec8<T>::element_to_float(bias[n0 + col]) : 0.f;
    const float b1 = bias && in ? PeVec8<T>::element_to_float(bias[n0 + col + 1]) : 0.f;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int a = 4 * i + 2 * h;
      const uint32_t lo = PeVec8<T>::from_float(acc[a] + b0), hi = PeVec8<T>::from_float(acc[a + 1] + b1);
      *reinterpret_cast<uint32_t*>(out + (r0 + 8 * h) * L::kOutStride + col) = lo | (hi << 16);
    }
  }
  pe_pdl_wait();  // y may be read by the previous kernel
  pe_tma::named_sync(1, L::kConsumers);
  uint16_t* y = static_cast<uint16_t*>(p.y);
  for (int idx = tid; idx < L::kBM * L::kBN / 8; idx += L::kConsumers) {
    const int r = idx / (L::kBN / 8), c = idx % (L::kBN / 8) * 8;
    if (m0 + r < p.m && n0 + c < p.n)
      *reinterpret_cast<uint4*>(y + (int64_t)(m0 + r) * p.y_stride + n0 + c) =
          *reinterpret_cast<const uint4*>(out + r * L::kOutStride + c);
  }
#else
  (void)map_x, (void)map_w, (void)p, (void)splits;
#endif
}

template <typename T, int BN, bool kSequential>
int launch_wide(const InvariantGemmParams& p, int splits, cudaStream_t s) {
  using L = WideTile<BN>;
  const auto kernel = wgmma_wide_kernel<T, BN, kSequential>;
  static const cudaError_t attr_rc =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)L::kSmemBytes);
  if (attr_rc != cudaSuccess) return (int)attr_rc;
  CUtensorMap map_x, map_w;
  if (!pe_tma::encode(&map_x, p.dtype, p.x, (uint64_t)p.k, (uint64_t)p.m, p.x_stride, L::kBM) ||
      !pe_tma::encode(&map_w, p.dtype, p.w, (uint64_t)p.n, (uint64_t)p.k, p.n, kBK))
    return -1;
  const int64_t tiles = (int64_t)((p.m + L::kBM - 1) / L::kBM) * ((p.n + L::kBN - 1) / L::kBN);
  if (tiles > 0x7fffffff) return -1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3((unsigned)tiles);
  cfg.blockDim = dim3(L::kThreads);
  cfg.dynamicSmemBytes = L::kSmemBytes;
  cfg.stream = s;
  cudaLaunchAttribute attr;
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = &attr;
  cfg.numAttrs = p.pdl ? 1 : 0;
  const cudaError_t rc = cudaLaunchKernelEx(&cfg, kernel, map_x, map_w, p, splits);
  return rc != cudaSuccess ? (int)rc : (int)cudaGetLastError();
}

template <typename T>
int launch_width(const InvariantGemmParams& p, int splits, int width, cudaStream_t s) {
  if (width == 256) return splits == 1 ? launch_wide<T, 256, false>(p, 1, s) : -1;
  return splits == 1 ? launch_wide<T, 192, false>(p, 1, s) : launch_wide<T, 192, true>(p, splits, s);
}

}  // namespace

int invariant_gemm_wgmma_wide_for(const InvariantGemmParams& p, int splits) {
  if (p.m <= 64 || reinterpret_cast<uintptr_t>(p.y) % 16 != 0 || p.y_stride % 8 != 0) return 0;
  if (splits == 1 && (int64_t)p.k * p.n < (int64_t{1} << 23) && p.num_sms > 0) {
    // Small weights (SmolLM2's qkv / o / gate_up, from kWgmmaSmallWeightRows rows): few blocks,
    // each short, so the waves of blocks times the width decide (the wider on a tie).
    const auto cost = [&](int width) {
      const int64_t blocks = (int64_t)((p.m + 127) / 128) * ((p.n + width - 1) / width);
      return (blocks + p.num_sms - 1) / p.num_sms * width;
    };
    int best = 256;
    for (const int width : {192, 128})
      if (cost(width) < cost(best)) best = width;
    return best == 128 ? 0 : best;
  }
  if (splits == 1) return 256;
  // A 192-wide block walks all k tiles; it beats the 128-wide cluster combine and walk unless its
  // blocks are too few for the chain (Llama-8B's down at 128 rows: 22 blocks of 224 k tiles).
  const int64_t blocks = (int64_t)((p.m + 127) / 128) * ((p.n + 191) / 192);
  return p.k / kBK <= 6 * blocks ? 192 : 0;
}

int launch_invariant_gemm_wgmma_wide(const InvariantGemmParams& p, int splits, int width, void* stream) {
  if ((width != 192 && width != 256) || reinterpret_cast<uintptr_t>(p.y) % 16 != 0 || p.y_stride % 8 != 0) return -1;
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  return p.dtype == PE_BFLOAT16 ? launch_width<pe_bf16>(p, splits, width, s)
                                : launch_width<pe_half>(p, splits, width, s);
}

#else  // not CUDA

int invariant_gemm_wgmma_wide_for(const InvariantGemmParams&, int) { return 0; }

int launch_invariant_gemm_wgmma_wide(const InvariantGemmParams&, int, int, void*) { return -1; }

#endif
