// One step's batch: flat arrays ready for the forward pass, handed to Python as numpy views.
#pragma once

#include <cstdint>
#include <memory>
#include <new>
#include <utility>
#include <vector>

namespace pyengine {

// Allocator that leaves new elements uninitialised: batch arrays are fully written by build_batch,
// so resize() need not zero them first (a second pass over every token on the step path).
template <typename T>
struct NoInitAllocator : std::allocator<T> {
  template <typename U>
  struct rebind {
    using other = NoInitAllocator<U>;
  };
  template <typename U>
  void construct(U* p) noexcept {
    ::new (static_cast<void*>(p)) U;  // placement: default-initialise, no allocation
  }
  template <typename U, typename... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
};
template <typename T>
using BatchArray = std::vector<T, NoInitAllocator<T>>;

// One step's batch. Per token: input_ids, positions, slot_mapping. Per row: the rest.
// Rows are ordered decode/verify rows first, then prefill chunks.
struct ScheduledBatch {
  BatchArray<int64_t> seq_ids;
  BatchArray<int64_t> input_ids;
  BatchArray<int64_t> positions;
  BatchArray<int64_t> slot_mapping;       // -1 for padding
  BatchArray<int32_t> query_start_loc;    // rows + 1
  BatchArray<int32_t> context_lens;       // KV length after this step
  BatchArray<int32_t> num_computed;       // KV length before this step
  BatchArray<int32_t> num_draft_tokens;   // drafts fed this step (0 for prefill rows)
  BatchArray<int32_t> cu_num_draft_tokens;  // rows + 1
  BatchArray<int32_t> num_logits;         // 1 + drafts (decode), 1 (last prefill chunk), 0
  BatchArray<int32_t> logits_indices;     // token indices whose logits are sampled
  BatchArray<int32_t> block_tables;       // rows x max_blocks, -1 padded
  int32_t max_blocks = 0;
  BatchArray<int32_t> state_slots;        // rows x slots_per_seq (hybrid models)
  BatchArray<int32_t> num_accepted_prev;  // tokens committed by each row's previous step
  // Recurrent-state copies the forward runs first, rows of (ssm slot, conv line, conv offset,
  // destination slot): state[dst] = state[ssm slot], conv[dst][0, W-1) = conv[line][offset, +W-1).
  // The first num_state_saves save the last step's states into checkpoints; the rest restore a
  // checkpoint into an admitted request's first slot (after its prefix hit). Saves run first.
  std::vector<int32_t> state_copies;
  int32_t num_state_saves = 0;
  // Per copy, the slots_per_seq state slots of its source: a save's row (slot 0 holds the base state,
  // slot t token t's record for Gated DeltaNet pools, pyengine/ops/reference/gdn.py), a restore's
  // checkpoint then PAD (-1).
  std::vector<int32_t> state_copy_slots;
  BatchArray<int32_t> request_slots;      // Sequence::slot of each row (a dense request index)
  BatchArray<int64_t> tokens_left;        // tokens each row may still commit, before this step
  std::vector<int64_t> preempted_seq_ids;
  int32_t num_decode_rows = 0;
  int32_t max_query_len = 0;
  int32_t max_context_len = 0;

  int32_t num_rows() const { return static_cast<int32_t>(seq_ids.size()); }
};

}  // namespace pyengine
