// Recurrent-state checkpoints for prefix caching of hybrid models: a pool of state slots, each
// holding the SSM/GDN and conv state at the end of one hashed KV block (the state after that
// block's last token). A prefix hit on a hybrid model restores the state of the last hit block, so
// a hit is usable only up to a block that owns a checkpoint.
//
// Checkpoints are a cache, never a requirement: a new one evicts the least recently used (created
// or hit) when the pool is full, and a block that loses its hash loses its checkpoint. Slot ids
// continue after the running requests' state slots: the state tensors hold both ranges.
//
// Invariants (check_invariants): a slot is free or owned by exactly one block, and that block
// points back at it; every owned slot is in the LRU list exactly once.
#pragma once

#include <cstdint>
#include <vector>

#include "common/common.h"

namespace pyengine {

class StateCheckpointPool {
 public:
  StateCheckpointPool(int32_t num_blocks, int32_t first_slot, int32_t num_slots)
      : first_slot_(first_slot),
        slot_of_block_(num_blocks, -1),
        block_of_(num_slots, -1),
        prev_(num_slots, -1),
        next_(num_slots, -1) {
    PE_CHECK(num_slots >= 0 && first_slot >= 0, "checkpoint slot counts must be >= 0");
    for (int32_t i = num_slots - 1; i >= 0; --i) free_.push_back(i);
  }

  int32_t num_slots() const { return static_cast<int32_t>(block_of_.size()); }
  int32_t num_used() const { return num_slots() - static_cast<int32_t>(free_.size()); }
  bool enabled() const { return num_slots() > 0; }
  // The state slot holding the checkpoint at the end of `block`, or -1.
  int32_t slot_of(int32_t block) const {
    const int32_t i = slot_of_block_[block];
    return i < 0 ? -1 : first_slot_ + i;
  }

  // A hit or a recomputation of the same state: the checkpoint becomes the most recently used.
  void touch(int32_t block) {
    const int32_t i = slot_of_block_[block];
    if (i < 0) return;
    unlink(i);
    push_back(i);
  }

  // A slot for the state at the end of `block` (which has none), evicting the least recently used
  // checkpoint when the pool is full; -1 for an empty pool. The caller copies the state in.
  int32_t assign(int32_t block) {
    PE_ASSERT(slot_of_block_[block] < 0);
    if (!enabled()) return -1;
    int32_t i;
    if (!free_.empty()) {
      i = free_.back();
      free_.pop_back();
    } else {
      i = head_;
      unlink(i);
      slot_of_block_[block_of_[i]] = -1;
    }
    block_of_[i] = block;
    slot_of_block_[block] = i;
    push_back(i);
    return first_slot_ + i;
  }

  // `block` lost its hash (evicted): its state can never be hit again.
  void drop(int32_t block) {
    const int32_t i = slot_of_block_[block];
    if (i < 0) return;
    unlink(i);
    slot_of_block_[block] = -1;
    block_of_[i] = -1;
    free_.push_back(i);
  }

  template <typename HasHash>
  void check_invariants(HasHash has_hash) const {
    int64_t listed = 0;
    for (int32_t i = head_; i >= 0; i = next_[i]) {
      PE_ASSERT(block_of_[i] >= 0 && slot_of_block_[block_of_[i]] == i && has_hash(block_of_[i]));
      ++listed;
    }
    PE_ASSERT(listed == num_used());
    for (int32_t i : free_) PE_ASSERT(block_of_[i] < 0);
    for (size_t b = 0; b < slot_of_block_.size(); ++b)
      PE_ASSERT(slot_of_block_[b] < 0 || block_of_[slot_of_block_[b]] == static_cast<int32_t>(b));
  }

 private:
  void unlink(int32_t i) {
    if (prev_[i] >= 0) next_[prev_[i]] = next_[i]; else head_ = next_[i];
    if (next_[i] >= 0) prev_[next_[i]] = prev_[i]; else tail_ = prev_[i];
    prev_[i] = next_[i] = -1;
  }
  void push_back(int32_t i) {
    prev_[i] = tail_;
    next_[i] = -1;
    if (tail_ >= 0) next_[tail_] = i; else head_ = i;
    tail_ = i;
  }

  int32_t first_slot_;
  std::vector<int32_t> slot_of_block_;  // per KV block: checkpoint index, or -1
  std::vector<int32_t> block_of_;       // per checkpoint index: owning block, or -1 (free)
  std::vector<int32_t> prev_, next_;    // LRU list over owned checkpoints, oldest at head_
  int32_t head_ = -1, tail_ = -1;
  std::vector<int32_t> free_;
};

}  // namespace pyengine
