// Allocator for the pool-sized tables that the step path reads at random (the prefix-cache index,
// per-block metadata, the hashed blocks' tokens). Tables of 2 MiB or more are 2 MiB aligned and
// advised to use transparent huge pages: a random access then costs a cache miss but rarely also
// a TLB miss (with 4 KiB pages, tables of a few MiB spread over more pages than the TLB holds).
#pragma once

#include <cstddef>
#include <cstdlib>
#include <memory>
#include <new>

#ifdef __linux__
#include <sys/mman.h>
#endif

namespace pyengine {

constexpr size_t kHugePage = size_t{2} << 20;

// bytes rounded up to whole 2 MiB pages, 2 MiB aligned, advised to use transparent huge pages;
// std::free releases it. Throws std::bad_alloc.
inline void* huge_page_alloc(size_t bytes) {
  const size_t rounded = (bytes + kHugePage - 1) / kHugePage * kHugePage;
  void* p = std::aligned_alloc(kHugePage, rounded);
  if (p == nullptr) throw std::bad_alloc();
#ifdef __linux__
  madvise(p, rounded, MADV_HUGEPAGE);  // advisory: without THP this is plain memory
#endif
  return p;
}

template <typename T>
struct HugePageAllocator {
  using value_type = T;

  HugePageAllocator() = default;
  template <typename U>
  HugePageAllocator(const HugePageAllocator<U>&) noexcept {}

  T* allocate(size_t n) {
    const size_t bytes = n * sizeof(T);
    if (bytes < kHugePage) return std::allocator<T>().allocate(n);
    return static_cast<T*>(huge_page_alloc(bytes));
  }
  void deallocate(T* p, size_t n) noexcept {
    if (n * sizeof(T) < kHugePage)
      std::allocator<T>().deallocate(p, n);
    else
      std::free(p);
  }
};

template <typename T, typename U>
bool operator==(const HugePageAllocator<T>&, const HugePageAllocator<U>&) { return true; }
template <typename T, typename U>
bool operator!=(const HugePageAllocator<T>&, const HugePageAllocator<U>&) { return false; }

}  // namespace pyengine
