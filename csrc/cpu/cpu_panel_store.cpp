// cpu_panel_store.h: slabs of 2 MiB pages for packed weights.
#include "cpu_panel_store.h"

#include <cstdlib>
#include <map>
#include <mutex>

#include "common/huge_page_allocator.h"

namespace pyengine::cpu {
namespace {

constexpr size_t kAlign = 64;  // a cache line: the kernels' loads never straddle two

struct Slab {
  size_t used = 0;   // bytes handed out from its start
  int64_t live = 0;  // matrices not yet freed
};

struct Slabs {
  std::mutex mutex;
  std::map<uintptr_t, Slab> by_base;
  uintptr_t current = 0;  // the slab new matrices come from (0: none yet)
};

Slabs& slabs() {
  static Slabs s;
  return s;
}

}  // namespace

void* panel_alloc(size_t bytes) {
  if (bytes >= kSlabBytes / 2) return huge_page_alloc(bytes);
  const size_t size = bytes == 0 ? kAlign : (bytes + kAlign - 1) / kAlign * kAlign;
  Slabs& s = slabs();
  std::lock_guard<std::mutex> lock(s.mutex);
  if (s.current == 0 || s.by_base[s.current].used + size > kSlabBytes) {
    if (s.current != 0 && s.by_base[s.current].live == 0) {  // a retired slab nothing lives in
      std::free(reinterpret_cast<void*>(s.current));
      s.by_base.erase(s.current);
    }
    s.current = 0;
    const auto base = reinterpret_cast<uintptr_t>(huge_page_alloc(kSlabBytes));
    s.by_base[base] = Slab{};
    s.current = base;
  }
  Slab& slab = s.by_base[s.current];
  void* p = reinterpret_cast<void*>(s.current + slab.used);
  slab.used += size, ++slab.live;
  return p;
}

void panel_free(void* p, size_t bytes) noexcept {
  if (p == nullptr) return;
  if (bytes >= kSlabBytes / 2) {
    std::free(p);
    return;
  }
  Slabs& s = slabs();
  std::lock_guard<std::mutex> lock(s.mutex);
  auto it = s.by_base.upper_bound(reinterpret_cast<uintptr_t>(p));
  --it;  // the slab p was carved from
  if (--it->second.live > 0) return;
  if (it->first == s.current) {
    it->second.used = 0;  // empty: carve again from its start
    return;
  }
  std::free(reinterpret_cast<void*>(it->first));
  s.by_base.erase(it);
}

}  // namespace pyengine::cpu
