// Where packed GEMM weights live: 2 MiB pages for all of them, the small ones sharing slabs.
//
// Why: a decode step streams every weight once (~96 MB for SmolLM2-135M Q4_1), most of them in
// matrices of 0.2-1.1 MB. On 4 KiB pages each page starts with demand misses (the hardware
// prefetchers stop at page boundaries) and a TLB walk; on the 2-core EPYC the 4-bit layers
// streamed 1.2-1.4x faster from 2 MiB pages (benchmarks in docs/kernels/cpu.md). Giving each
// matrix its own 2 MiB pages would more than double the resident size, so matrices under
// kSlabBytes / 2 are carved from shared 32 MiB slabs (2 MiB aligned, MADV_HUGEPAGE), 64-byte
// aligned, one after another in allocation order (a model's layers end up contiguous). A slab
// is freed when its last matrix is; larger matrices get their own 2 MiB-aligned allocation.
#pragma once

#include <cstddef>
#include <cstdint>
#include <new>
#include <vector>

namespace pyengine::cpu {

constexpr size_t kSlabBytes = size_t{32} << 20;

// bytes (> 0) on 2 MiB pages where the kernel gives them; throws std::bad_alloc.
void* panel_alloc(size_t bytes);
// p from panel_alloc(bytes).
void panel_free(void* p, size_t bytes) noexcept;

template <typename T>
struct PanelAllocator {
  using value_type = T;
  PanelAllocator() = default;
  template <typename U>
  PanelAllocator(const PanelAllocator<U>&) noexcept {}
  T* allocate(size_t n) { return static_cast<T*>(panel_alloc(n * sizeof(T))); }
  void deallocate(T* p, size_t n) noexcept { panel_free(p, n * sizeof(T)); }
};
template <typename T, typename U>
bool operator==(const PanelAllocator<T>&, const PanelAllocator<U>&) { return true; }
template <typename T, typename U>
bool operator!=(const PanelAllocator<T>&, const PanelAllocator<U>&) { return false; }

// A packed weight's words (cpu_gemm.h, cpu_gemm_affine.h, cpu_gemm_qdot.h).
using PanelStore = std::vector<uint32_t, PanelAllocator<uint32_t>>;

}  // namespace pyengine::cpu
