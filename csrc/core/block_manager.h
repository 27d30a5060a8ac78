// Paged KV-cache blocks (ref counts, free pool, prefix caching) and recurrent-state slots.
//
// Invariants (asserted by check_invariants and by the property tests):
//  - every block is either in use (ref_count > 0, in no free list) or free (ref_count 0, in exactly
//    one of: the uncached stack, the LRU list of cached blocks);
//  - a hash entry maps to a block whose stored tokens, parent hash and salt produced that hash;
//  - a hash is published only for full blocks of committed tokens whose KV the forward wrote;
//  - a request writes only into blocks it holds alone (ref_count == 1).
#pragma once

#include <cstdint>
#include <vector>

#include "block_hash_table.h"
#include "common/common.h"
#include "state_checkpoints.h"
#include "common/huge_page_allocator.h"

namespace pyengine {

// Per-request allocation state. Plain data, owned by the Sequence (or by the test-facing map).
struct KVAllocation {
  std::vector<int32_t> block_table;
  int32_t num_hashed_blocks = 0;  // watermark: blocks [0, n) are published or were prefix hits
  bool allocated = false;
  uint64_t last_block_hash = 0;   // chain parent for block num_hashed_blocks
  int64_t cache_salt = 0;         // extra key mixed into every hash of this request
  std::vector<int32_t> state_slots;  // recurrent-state slots (hybrid models), 1 + k of them
  std::vector<uint64_t> block_hashes;  // chain hash of each block below the watermark (kept only
                                       // with state checkpoints: they are keyed by these hashes)
};

struct PrefixMatch {
  std::vector<int32_t> hit_blocks;  // block ids matching the first full blocks of the prompt
  int32_t num_hits_on_free = 0;     // of those, how many have ref 0 (claiming consumes free capacity)
  uint64_t last_hash = 0;           // chain hash of the last hit block
};

class BlockManager {
 public:
  // num_state_checkpoints: the checkpoint pool of a hybrid model with prefix caching (slot ids
  // num_state_slots ..); with state slots but no checkpoints a prefix never hits.
  BlockManager(int32_t num_blocks, int32_t block_size, bool enable_prefix_caching,
               int32_t num_state_slots, int32_t state_slots_per_seq, int32_t num_state_checkpoints = 0);

  // The one allocation formula: new blocks needed so that positions [0, end) are covered.
  // ceil(end / B) - len(block_table), never negative; the common case (already covered) divides
  // nothing.
  int64_t blocks_needed(const KVAllocation& alloc, int64_t end) const {
    const int64_t covered = static_cast<int64_t>(alloc.block_table.size()) * block_size_;
    return end <= covered ? 0 : ceil_div(end - covered, block_size_);
  }

  // Admission of a prompt (or a preempted request's tokens): side-effect free check and the apply.
  // lookahead: positions beyond the tokens that the first decode/verify step may write.
  bool can_allocate(const int32_t* tokens, int64_t num_tokens, int64_t lookahead, int64_t salt) const;
  // Returns the number of cached (prefix-hit) tokens; always < num_tokens.
  int64_t allocate(KVAllocation& alloc, const int32_t* tokens, int64_t num_tokens, int64_t lookahead,
                   int64_t salt);

  // A step writing positions [num_computed, num_computed + n).
  bool can_append(const KVAllocation& alloc, int64_t num_computed, int64_t n) const {
    return blocks_needed(alloc, num_computed + n) <= num_free_blocks();
  }
  void append(KVAllocation& alloc, int64_t num_computed, int64_t n);

  // Publish hashes for every full block in [watermark, num_valid / B), where num_valid =
  // min(num_computed, num_committed_tokens): KV written and tokens committed.
  void cache_full_blocks(KVAllocation& alloc, const int32_t* tokens, int64_t num_valid) {
    hash_full_blocks(alloc, tokens, num_valid);
    publish_hashes();
  }
  // The same in two phases, for a step over many requests: hash_full_blocks computes the chain
  // hashes of the newly full blocks, advances the watermark and queues them (prefetching their
  // hash-table slots); publish_hashes inserts the queue in order. Each insert is a random access
  // into a pool-sized table: queued, the misses of a whole step overlap instead of stalling one by
  // one. `tokens` must stay valid, and the queued blocks held, until publish_hashes (which asserts
  // that each still has ref count 1).
  void hash_full_blocks(KVAllocation& alloc, const int32_t* tokens, int64_t num_valid);
  void publish_hashes();
  // Cheap test callers use to skip the call on the step path (most steps fill no block).
  bool has_new_full_block(const KVAllocation& alloc, int64_t num_valid) const {
    return enable_prefix_caching_ && num_valid >= (alloc.num_hashed_blocks + int64_t{1}) * block_size_;
  }

  void free(KVAllocation& alloc);

  // Recurrent-state checkpoints (state_checkpoints.h). The slot to restore a request's state from
  // after a prefix hit of num_hit_blocks blocks (allocate only hits blocks that have one).
  int32_t restore_slot(const KVAllocation& alloc, int64_t num_hit_blocks) const {
    return checkpoints_.slot_of(alloc.block_table[num_hit_blocks - 1]);
  }
  // A new checkpoint slot for the state at the end of the request's hashed block `index`, or -1
  // when the block holding that hash has one already (it becomes the most recent) or the pool is
  // empty. The caller copies the state in before anything can hit it.
  int32_t assign_checkpoint(const KVAllocation& alloc, int64_t index);

  int32_t num_free_blocks() const {
    return static_cast<int32_t>(free_uncached_.size()) + lru_size_;
  }
  int32_t num_blocks() const { return static_cast<int32_t>(blocks_.size()); }
  int32_t block_size() const { return block_size_; }
  int32_t num_free_state_slots() const { return static_cast<int32_t>(free_state_slots_.size()); }
  int32_t num_state_checkpoints() const { return checkpoints_.num_slots(); }
  int32_t num_used_state_checkpoints() const { return checkpoints_.num_used(); }
  int32_t checkpoint_slot_of_block(int32_t block_id) const;
  int32_t state_slots_per_seq() const { return state_slots_per_seq_; }
  bool prefix_caching() const { return enable_prefix_caching_; }

  // Introspection for tests.
  int32_t ref_count(int32_t block_id) const;
  bool block_has_hash(int32_t block_id) const;
  std::vector<int32_t> block_tokens(int32_t block_id) const;
  std::vector<int32_t> hashed_block_ids() const;  // blocks the hash table points to
  // Verifies the free-pool and hash-table invariants; tables = all live allocations.
  void check_invariants(const std::vector<const KVAllocation*>& tables) const;

 private:
  struct Block {
    int32_t ref_count = 0;
    bool has_hash = false;
    uint64_t hash = 0;
    uint64_t parent_hash = 0;
    int64_t salt = 0;
    int32_t lru_prev = -1, lru_next = -1;
    bool in_lru = false;
  };

  struct PendingHash {  // a full block hashed by hash_full_blocks, waiting for publish_hashes
    int32_t block_id;
    uint64_t hash, parent_hash;
    int64_t salt;
    const int32_t* tokens;
  };

  uint64_t hash_block(uint64_t parent, const int32_t* tokens, int64_t salt) const;
  const int32_t* tokens_of(int32_t id) const { return block_tokens_.data() + static_cast<size_t>(id) * block_size_; }
  PrefixMatch match_prefix(const int32_t* tokens, int64_t num_tokens, int64_t salt) const;
  int32_t take_free_block();
  void release_block(int32_t block_id);
  void lru_push_back(int32_t id);
  void lru_remove(int32_t id);

  int32_t block_size_;
  bool enable_prefix_caching_;
  int32_t state_slots_per_seq_;
  // Pool-sized and read at random by the step path (see huge_page_allocator.h).
  std::vector<Block, HugePageAllocator<Block>> blocks_;
  // num_blocks x block_size: each hashed block's tokens, for the equality check on a hit (flat:
  // no allocation per block).
  std::vector<int32_t, HugePageAllocator<int32_t>> block_tokens_;
  std::vector<int32_t> free_uncached_;  // stack of free blocks without a hash
  int32_t lru_head_ = -1, lru_tail_ = -1, lru_size_ = 0;  // free cached blocks, oldest first
  BlockHashTable hash_to_block_;
  std::vector<PendingHash> pending_hashes_;  // empty outside a hash_full_blocks/publish_hashes pair
  std::vector<int32_t> free_state_slots_;
  int32_t num_state_slots_;
  StateCheckpointPool checkpoints_;
};

}  // namespace pyengine
