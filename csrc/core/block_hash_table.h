// Prefix-cache index: block hash -> block id. Open addressing with linear probing and
// backward-shift deletion, sized once for the pool (at most one entry per block), so publishing
// or evicting a hash never allocates on the step path.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "common/huge_page_allocator.h"

namespace pyengine {

class BlockHashTable {
 public:
  explicit BlockHashTable(int32_t max_entries) {
    size_t cap = 16;
    while (cap < static_cast<size_t>(max_entries) * 2) cap <<= 1;  // load factor <= 0.5
    slots_.assign(cap, Entry{});
    mask_ = cap - 1;
  }

  // Block id for hash, or -1.
  int32_t find(uint64_t hash) const {
    for (size_t i = hash & mask_;; i = (i + 1) & mask_) {
      const Entry& e = slots_[i];
      if (e.block < 0) return -1;
      if (e.hash == hash) return e.block;
    }
  }

  // Starts loading the probe run of hash into cache (a lookup is one random access into a table
  // sized for the whole pool, so batched callers overlap these misses).
  void prefetch(uint64_t hash) const { __builtin_prefetch(&slots_[hash & mask_]); }

  // Inserts unless the hash is present; returns whether it inserted.
  bool insert(uint64_t hash, int32_t block) {
    size_t i = hash & mask_;
    for (; slots_[i].block >= 0; i = (i + 1) & mask_)
      if (slots_[i].hash == hash) return false;
    slots_[i] = Entry{hash, block};
    ++size_;
    return true;
  }

  // Removes hash if it maps to block.
  void erase(uint64_t hash, int32_t block) {
    size_t i = hash & mask_;
    for (;; i = (i + 1) & mask_) {
      if (slots_[i].block < 0) return;
      if (slots_[i].hash == hash) break;
    }
    if (slots_[i].block != block) return;
    // Backward shift: pull later entries of the probe run into the hole so lookups stay correct.
    for (size_t j = (i + 1) & mask_;; j = (j + 1) & mask_) {
      if (slots_[j].block < 0) break;
      size_t home = slots_[j].hash & mask_;
      bool movable = (i <= j) ? (home <= i || home > j) : (home <= i && home > j);
      if (movable) {
        slots_[i] = slots_[j];
        i = j;
      }
    }
    slots_[i] = Entry{};
    --size_;
  }

  size_t size() const { return size_; }

  template <typename F>
  void for_each(F&& f) const {
    for (const Entry& e : slots_)
      if (e.block >= 0) f(e.hash, e.block);
  }

 private:
  struct Entry {
    uint64_t hash = 0;
    int32_t block = -1;
  };
  std::vector<Entry, HugePageAllocator<Entry>> slots_;
  size_t mask_ = 0;
  size_t size_ = 0;
};

}  // namespace pyengine
