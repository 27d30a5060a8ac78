// Warpgroup matrix products D (64 x N, fp32) += A (64 x 16) * B (16 x N) on 16-bit operands that sit
// in shared memory in the tensor cores' 128-byte-swizzled layout. On sm_90a this is wgmma.mma_async:
// the tensor cores read both operands from shared memory, so a 64-row A tile is fetched once per
// product instead of once per warp (mma.sync), which is what lets MLA's ~240 flop/byte keep up with
// HBM. Elsewhere (HIP for AMD, other NVIDIA targets), or where the caller asks for it (kTensor =
// false: the small MLA configuration, which must also be testable on an H100), a plain-FMA fallback
// reads the same tiles and produces the same accumulator layout (fp32, up to summation order). The
// fallback also takes groups of kWarps = 1 .. 4 warps (16 kWarps rows of A), so that a block with
// fewer query rows keeps every warp busy.
//
// Tile layout: an [R][C] matrix (C a multiple of 64, R a multiple of 8) is stored as C / 64 slabs of
// [R][64]; each row of a slab is 128 bytes and its 16-byte chunk j sits at chunk j ^ (row % 8); the
// tile base is 1024-byte aligned. (The wgmma "128B swizzle" canonical layout.)
// Accumulator layout (the wgmma one): warp w of the group (kWarps consecutive warps), lane 4 g + q,
// holds d[4 i + e] = D[16 w + g + 8 (e / 2)][8 i + 2 q + e % 2].
#pragma once

#include <type_traits>

#include "common/hip_compat.h"

#if defined(PE_CUDA) && defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define PE_WGMMA 1
#endif

namespace pe_wg {

#if defined(PE_WGMMA)
constexpr bool kHaveWgmma = true;
#else
constexpr bool kHaveWgmma = false;
#endif

// Element offset of (r, c) in a slab tile of R rows.
PE_DEVICE int slab_off(int r, int c, int R) {
  return (c >> 6) * R * 64 + r * 64 + ((((c >> 3) & 7) ^ (r & 7)) << 3) + (c & 7);
}

// Bytes to skip from p to the next 1024-byte boundary of the shared window (the swizzle pattern is a
// function of the address bits, so the tiles must start there); 0 for the fallback.
PE_DEVICE int align_1024(const void* p) {
#if defined(PE_WGMMA)
  return (int)((1024u - (static_cast<uint32_t>(__cvta_generic_to_shared(p)) & 1023u)) & 1023u);
#else
  return 0;
#endif
}

#if defined(PE_WGMMA)
// Shared-memory matrix descriptor: start address, leading / stride byte offsets, 128-byte swizzle.
PE_DEVICE uint64_t desc(const void* p, uint32_t lbo, uint32_t sbo) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  return (uint64_t)((a >> 4) & 0x3fffu) | ((uint64_t)((lbo >> 4) & 0x3fffu) << 16) |
         ((uint64_t)((sbo >> 4) & 0x3fffu) << 32) | (1ull << 62);
}

// Operand lists of the asm statements (accumulator registers %0 .. %N-1).
#define PE_WG_REGS32 \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define PE_WG_OUTS32(d) \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
  "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
  "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
  "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define PE_WG_REGS128 \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, " \
  "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
  "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, " \
  "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
  "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
#define PE_WG_OUTS128(d) \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
  "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
  "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
  "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
  "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
  "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
  "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
  "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), \
  "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), \
  "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), \
  "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), \
  "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), \
  "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), \
  "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), \
  "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), \
  "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])

#define PE_WGMMA_ASM(SHAPE_TYPES, REGS, IA, IB, IS, TRANS_B, OUTS)                                              \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" IS ", 0;\nwgmma.mma_async.sync.aligned." SHAPE_TYPES " {" REGS \
               "}, %" IA ", %" IB ", p, 1, 1, 0, " TRANS_B ";\n}\n"                                             \
               : OUTS                                                                                         \
               : "l"(da), "l"(db), "r"(1))
#endif

// The order of a batch of tensor-core products: fence_operands(d); begin(); products...; end();
// fence_operands(d). begin orders the register writes before it (e.g. a rescale of d) before the
// asynchronous products; end waits for them; fence_operands keeps the compiler from moving accesses
// of d across either. (FMA products are synchronous and need none of these.)
template <int N>
PE_DEVICE void fence_operands(float (&d)[N]) {
#if defined(PE_WGMMA)
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
#endif
}
PE_DEVICE void begin() {
#if defined(PE_WGMMA)
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
// Closes the batch of products issued since begin() (commit) and waits for it (wait); split, a
// warpgroup can do other work (copies, barriers) in between. d must not be touched until wait().
PE_DEVICE void commit() {
#if defined(PE_WGMMA)
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
PE_DEVICE void wait() {
#if defined(PE_WGMMA)
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
#endif
}
// Waits until at most N of the warpgroup's committed batches are still running (they complete in
// order): a batch issued after another can be left in flight while the earlier one is used.
template <int N>
PE_DEVICE void wait_pending() {
#if defined(PE_WGMMA)
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}
PE_DEVICE void end() {
  commit();
  wait();
}
// Shared memory written by ordinary stores or cp.async, read next by wgmma (the async proxy): each
// writing thread fences after its writes have landed, before the barrier that publishes them.
PE_DEVICE void fence_smem_for_async_reads() {
#if defined(PE_WGMMA)
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

// Fallback: each lane computes its own accumulator entries from shared memory. The lane's two A
// rows (16 values each) and each B column are read once per product and kept in registers; the loops
// are unrolled so that d stays in registers (an indexed d would live in local / scratch memory).
template <typename T, int N, int kWarps, bool B_ROWS_ARE_N>
PE_DEVICE void fma_product(float (&d)[N / 2], const T* a, int a_rows, int ar0, int ac0, const T* b, int b_rows,
                           int b0, int b1) {
  static_assert(N % 8 == 0 && kWarps >= 1 && kWarps <= 4, "accumulator layout");
  const int w = (threadIdx.x >> 5) % kWarps, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
  float av[2][16];
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int k = 0; k < 16; ++k) av[h][k] = Io<T>::ld(a + slab_off(ar0 + 16 * w + g + 8 * h, ac0 + k, a_rows));
#pragma unroll
  for (int i = 0; i < N / 8; ++i)
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int n = 8 * i + 2 * q + c;
      float bv[16];
#pragma unroll
      for (int k = 0; k < 16; ++k)
        bv[k] = Io<T>::ld(b + (B_ROWS_ARE_N ? slab_off(b0 + n, b1 + k, b_rows) : slab_off(b0 + k, b1 + n, b_rows)));
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float acc = d[4 * i + 2 * h + c];
#pragma unroll
        for (int k = 0; k < 16; ++k) acc += av[h][k] * bv[k];
        d[4 * i + 2 * h + c] = acc;
      }
    }
}

// The products on descriptors the caller keeps: a tile's descriptor is computed once and a k-step's
// operand is reached by adding step_desc of its element offset (the address field is the byte
// address / 16, and a tile lies below 256 KB, so the sum never carries out of it). The S chain of
// the MLA kernel issues 36 products a tile: computing each descriptor from a pointer (~12
// instructions) made issuing them, not the tensor cores, the chain's limit. sm_90a only (the bodies
// are empty elsewhere: callers are kernels built for sm_90a alone).
PE_DEVICE constexpr uint64_t step_desc(int elems16) { return (uint64_t)(elems16 * 2 / 16); }
// d + step, computed in the low word alone (the address field cannot carry into the high word):
// half the instructions of a 64-bit add, which the product chains issue once per product.
PE_DEVICE uint64_t desc_add(uint64_t d, uint64_t step) {
  return (d & 0xffffffff00000000ull) | (uint32_t)((uint32_t)d + (uint32_t)step);
}
// Element offset of slab tile column c of row 0 in a tile of R rows.
PE_DEVICE constexpr int slab_col(int c, int R) { return (c >> 6) * R * 64 + (c & 63); }
// d (64 x 256) += A (64 x 16 in registers: each warp's 16 rows as the m16n8k16 A fragment, which is
// also the layout of an m64nN accumulator's 16 columns) * B (MN-major, as mma_kn256).
template <typename T>
PE_DEVICE void mma_kn256_rs(float (&d)[128], const uint32_t (&a)[4], uint64_t db) {
#if defined(PE_WGMMA)
  if constexpr (std::is_same<T, pe_bf16>::value)
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {" PE_WG_REGS128 "}, {%128, %129, %130, %131}, %132, p, 1, 1, 1;\n}\n"
                 : PE_WG_OUTS128(d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
  else
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 {" PE_WG_REGS128 "}, {%128, %129, %130, %131}, %132, p, 1, 1, 1;\n}\n"
                 : PE_WG_OUTS128(d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
#endif
}
// Descriptors of a K-major operand (A, or B of product_nk) and of an MN-major B (product_kn: the
// leading offset steps between 64-column slabs, the stride between 8-row groups) of a slab tile of
// R rows.
PE_DEVICE uint64_t desc_k_major(const void* tile) {
#if defined(PE_WGMMA)
  return desc(tile, 16, 1024);
#else
  return 0;
#endif
}
PE_DEVICE uint64_t desc_mn_major(const void* tile, int R) {
#if defined(PE_WGMMA)
  return desc(tile, (uint32_t)R * 128u, 1024);
#else
  return 0;
#endif
}
template <typename T>
PE_DEVICE void mma_nk64(float (&d)[32], uint64_t da, uint64_t db) {
#if defined(PE_WGMMA)
  if constexpr (std::is_same<T, pe_bf16>::value)
    PE_WGMMA_ASM("m64n64k16.f32.bf16.bf16", PE_WG_REGS32, "32", "33", "34", "0", PE_WG_OUTS32(d));
  else
    PE_WGMMA_ASM("m64n64k16.f32.f16.f16", PE_WG_REGS32, "32", "33", "34", "0", PE_WG_OUTS32(d));
#endif
}
template <typename T>
PE_DEVICE void mma_kn256(float (&d)[128], uint64_t da, uint64_t db) {
#if defined(PE_WGMMA)
  if constexpr (std::is_same<T, pe_bf16>::value)
    PE_WGMMA_ASM("m64n256k16.f32.bf16.bf16", PE_WG_REGS128, "128", "129", "130", "1", PE_WG_OUTS128(d));
  else
    PE_WGMMA_ASM("m64n256k16.f32.f16.f16", PE_WG_REGS128, "128", "129", "130", "1", PE_WG_OUTS128(d));
#endif
}

// d (16 kWarps x N) += A * B with A = a[ar0 .. +16 kWarps][ac0 .. +16] and B[k][n] = b[bn0 + n][bk0 + k]:
// B stored with k contiguous ("K-major", e.g. the keys of S = Q K^T). ar0, bn0 multiples of 8, ac0, bk0
// of 16. Tensor cores only for N 64, a warpgroup, and kTensor.
template <typename T, int N, int kWarps = 4, bool kTensor = true>
PE_DEVICE void product_nk(float (&d)[N / 2], const T* a, int a_rows, int ar0, int ac0, const T* b, int b_rows,
                          int bn0, int bk0) {
  if constexpr (kTensor && kHaveWgmma) {
    static_assert(N == 64 && kWarps == 4, "wgmma: m64n64k16 only");
#if defined(PE_WGMMA)
    mma_nk64<T>(d, desc_k_major(a + slab_col(ac0, a_rows) + ar0 * 64),
                desc_k_major(b + slab_col(bk0, b_rows) + bn0 * 64));
#endif
  } else {
    fma_product<T, N, kWarps, true>(d, a, a_rows, ar0, ac0, b, b_rows, bn0, bk0);
  }
}

// d (16 kWarps x N) += A * B with A as above and B[k][n] = b[bk0 + k][bn0 + n]: B stored with n
// contiguous ("MN-major", e.g. the values of O += P V). bk0 a multiple of 16, bn0 of 64 (tensor
// cores) or 8. Tensor cores only for N 256, a warpgroup, and kTensor.
template <typename T, int N, int kWarps = 4, bool kTensor = true>
PE_DEVICE void product_kn(float (&d)[N / 2], const T* a, int a_rows, int ar0, int ac0, const T* b, int b_rows,
                          int bk0, int bn0) {
  if constexpr (kTensor && kHaveWgmma) {
    static_assert(N == 256 && kWarps == 4, "wgmma: m64n256k16 only");
#if defined(PE_WGMMA)
    mma_kn256<T>(d, desc_k_major(a + slab_col(ac0, a_rows) + ar0 * 64),
                 desc_mn_major(b + (bn0 >> 6) * b_rows * 64 + bk0 * 64, b_rows));
#endif
  } else {
    fma_product<T, N, kWarps, false>(d, a, a_rows, ar0, ac0, b, b_rows, bk0, bn0);
  }
}

}  // namespace pe_wg
