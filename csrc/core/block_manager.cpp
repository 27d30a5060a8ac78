#include "block_manager.h"

#include <algorithm>
#include <cstring>

#include "mix64.h"

namespace pyengine {

BlockManager::BlockManager(int32_t num_blocks, int32_t block_size, bool enable_prefix_caching,
                           int32_t num_state_slots, int32_t state_slots_per_seq, int32_t num_state_checkpoints)
    : block_size_(block_size),
      enable_prefix_caching_(enable_prefix_caching),
      state_slots_per_seq_(state_slots_per_seq),
      blocks_(num_blocks > 0 ? num_blocks : 0),
      hash_to_block_(num_blocks > 0 ? num_blocks : 0),
      num_state_slots_(num_state_slots),
      checkpoints_(num_blocks > 0 ? num_blocks : 0, num_state_slots > 0 ? num_state_slots : 0,
                   enable_prefix_caching && state_slots_per_seq > 0 ? num_state_checkpoints : 0) {
  PE_CHECK(num_blocks > 0, "num_blocks must be positive, got ", num_blocks);
  PE_CHECK(block_size > 0, "block_size must be positive, got ", block_size);
  PE_CHECK(num_state_slots >= 0 && state_slots_per_seq >= 0, "state slot counts must be >= 0");
  PE_CHECK(state_slots_per_seq == 0 || num_state_slots >= state_slots_per_seq,
           "num_state_slots (", num_state_slots, ") < state_slots_per_seq (", state_slots_per_seq, ")");
  block_tokens_.assign(static_cast<size_t>(blocks_.size()) * block_size, 0);
  free_uncached_.reserve(num_blocks);
  for (int32_t i = num_blocks - 1; i >= 0; --i) free_uncached_.push_back(i);  // pops 0, 1, 2, ...
  for (int32_t i = num_state_slots - 1; i >= 0; --i) free_state_slots_.push_back(i);
}

uint64_t BlockManager::hash_block(uint64_t parent, const int32_t* tokens, int64_t salt) const {
  uint64_t h = mix64(parent ^ 0x9e3779b97f4a7c15ULL) ^ mix64(static_cast<uint64_t>(salt) + 0x632be59bd9b4e019ULL);
  int32_t i = 0;
  for (; i + 1 < block_size_; i += 2) {  // two tokens per mixing round
    uint64_t pair = static_cast<uint64_t>(static_cast<uint32_t>(tokens[i])) |
                    (static_cast<uint64_t>(static_cast<uint32_t>(tokens[i + 1])) << 32);
    h = mix64(h ^ (pair + 0x2545f4914f6cdd1dULL * (i + 1)));
  }
  if (i < block_size_)
    h = mix64(h ^ (static_cast<uint64_t>(static_cast<uint32_t>(tokens[i])) + 0x2545f4914f6cdd1dULL * (i + 1)));
  return h;
}

PrefixMatch BlockManager::match_prefix(const int32_t* tokens, int64_t num_tokens, int64_t salt) const {
  PrefixMatch m;
  if (!enable_prefix_caching_) return m;
  // Hits stop one token short of the prompt so that the last token is always recomputed (a query
  // of length 0 has no logits) and so that writes never land in a shared block.
  const int64_t max_hits = (num_tokens - 1) / block_size_;
  uint64_t parent = 0;
  for (int64_t i = 0; i < max_hits; ++i) {
    const int32_t* blk = tokens + i * block_size_;
    uint64_t h = hash_block(parent, blk, salt);
    const int32_t id = hash_to_block_.find(h);
    if (id < 0) break;
    const Block& b = blocks_[id];
    // Equality check: a 64-bit collision must never serve another prefix's KV.
    if (b.parent_hash != parent || b.salt != salt ||
        std::memcmp(tokens_of(id), blk, sizeof(int32_t) * block_size_) != 0)
      break;
    m.hit_blocks.push_back(id);
    parent = h;
  }
  // A hybrid model resumes from the recurrent state at the end of the last hit block: the hit
  // ends at the last block that has a checkpoint.
  if (state_slots_per_seq_ > 0)
    while (!m.hit_blocks.empty() && checkpoints_.slot_of(m.hit_blocks.back()) < 0) m.hit_blocks.pop_back();
  for (int32_t id : m.hit_blocks) m.num_hits_on_free += blocks_[id].ref_count == 0;
  m.last_hash = m.hit_blocks.empty() ? 0 : blocks_[m.hit_blocks.back()].hash;
  return m;
}

bool BlockManager::can_allocate(const int32_t* tokens, int64_t num_tokens, int64_t lookahead,
                                int64_t salt) const {
  if (state_slots_per_seq_ > 0 && num_free_state_slots() < state_slots_per_seq_) return false;
  PrefixMatch m = match_prefix(tokens, num_tokens, salt);
  int64_t total = ceil_div(num_tokens + lookahead, block_size_);
  int64_t fresh = total - static_cast<int64_t>(m.hit_blocks.size());
  return fresh + m.num_hits_on_free <= num_free_blocks();
}

int64_t BlockManager::allocate(KVAllocation& alloc, const int32_t* tokens, int64_t num_tokens,
                               int64_t lookahead, int64_t salt) {
  PE_CHECK(!alloc.allocated, "request already holds blocks (allocate called twice)");
  PE_CHECK(num_tokens > 0, "cannot allocate an empty prompt");
  PE_CHECK(lookahead >= 0, "lookahead must be >= 0, got ", lookahead);
  if (!can_allocate(tokens, num_tokens, lookahead, salt))
    throw NoFreeBlocksError(concat("cannot allocate ", ceil_div(num_tokens + lookahead, block_size_),
                                   " blocks: ", num_free_blocks(), " free (check can_allocate first)"));
  PrefixMatch m = match_prefix(tokens, num_tokens, salt);
  // Claim hits first: a hit on a free cached block leaves the LRU list (keeping its hash) before
  // fresh allocations could evict it.
  for (int32_t id : m.hit_blocks) {
    Block& b = blocks_[id];
    if (b.ref_count == 0) lru_remove(id);
    ++b.ref_count;
  }
  alloc.block_table = m.hit_blocks;
  alloc.num_hashed_blocks = static_cast<int32_t>(m.hit_blocks.size());
  if (checkpoints_.enabled()) {
    for (int32_t id : m.hit_blocks) alloc.block_hashes.push_back(blocks_[id].hash);
    if (!m.hit_blocks.empty()) checkpoints_.touch(m.hit_blocks.back());
  }
  alloc.last_block_hash = m.last_hash;
  alloc.cache_salt = salt;
  int64_t total = ceil_div(num_tokens + lookahead, block_size_);
  for (int64_t i = static_cast<int64_t>(m.hit_blocks.size()); i < total; ++i)
    alloc.block_table.push_back(take_free_block());
  for (int32_t i = 0; i < state_slots_per_seq_; ++i) {
    alloc.state_slots.push_back(free_state_slots_.back());
    free_state_slots_.pop_back();
  }
  alloc.allocated = true;
  return static_cast<int64_t>(m.hit_blocks.size()) * block_size_;
}

void BlockManager::append(KVAllocation& alloc, int64_t num_computed, int64_t n) {
  PE_CHECK(alloc.allocated, "append on a request that holds no blocks");
  PE_CHECK(num_computed >= 0 && n >= 0, "append needs num_computed >= 0 and n >= 0");
  int64_t need = blocks_needed(alloc, num_computed + n);
  if (need > num_free_blocks())
    throw NoFreeBlocksError(concat("append needs ", need, " new blocks, ", num_free_blocks(),
                                   " free (check can_append first)"));
  for (int64_t i = 0; i < need; ++i) alloc.block_table.push_back(take_free_block());
  // Never write into a block another request reads (a shared prefix block). Only blocks below the
  // hash watermark can be shared: a prefix hit claims hashed blocks only, and the blocks past the
  // watermark were taken fresh and are never hashed (check_invariants asserts both). A decode step
  // writes past the watermark, so this loop is empty on the step path.
  const int64_t end = num_computed + n;
  if (num_computed < static_cast<int64_t>(alloc.num_hashed_blocks) * block_size_) {
    for (int64_t p = num_computed / block_size_; p < alloc.num_hashed_blocks && p * block_size_ < end; ++p)
      PE_CHECK(blocks_[alloc.block_table[p]].ref_count == 1, "a write at position ", p * block_size_,
               " would land in shared block ", alloc.block_table[p]);
  }
}

void BlockManager::hash_full_blocks(KVAllocation& alloc, const int32_t* tokens, int64_t num_valid) {
  const int64_t full = std::min<int64_t>(num_valid / block_size_, alloc.block_table.size());
  if (!enable_prefix_caching_ || !alloc.allocated || full <= alloc.num_hashed_blocks) return;
  for (int64_t i = alloc.num_hashed_blocks; i < full; ++i) {
    const int32_t* blk = tokens + i * block_size_;
    const uint64_t h = hash_block(alloc.last_block_hash, blk, alloc.cache_salt);
    const int32_t id = alloc.block_table[i];
    hash_to_block_.prefetch(h);
    __builtin_prefetch(&blocks_[id], 1);
    __builtin_prefetch(tokens_of(id), 1);
    pending_hashes_.push_back({id, h, alloc.last_block_hash, alloc.cache_salt, blk});
    if (checkpoints_.enabled()) alloc.block_hashes.push_back(h);
    alloc.last_block_hash = h;
  }
  alloc.num_hashed_blocks = static_cast<int32_t>(full);
}

void BlockManager::publish_hashes() {
  for (const PendingHash& p : pending_hashes_) {
    Block& b = blocks_[p.block_id];
    PE_ASSERT(!b.has_hash && b.ref_count == 1);
    // Another block may already hold the same content (recomputed after a partial hit): keep the
    // first; this one stays unhashed and returns to the plain free pool later.
    if (hash_to_block_.insert(p.hash, p.block_id)) {
      b.has_hash = true;
      b.hash = p.hash;
      b.parent_hash = p.parent_hash;
      b.salt = p.salt;
      std::copy_n(p.tokens, block_size_, block_tokens_.data() + static_cast<size_t>(p.block_id) * block_size_);
    }
  }
  pending_hashes_.clear();
}

void BlockManager::free(KVAllocation& alloc) {
  PE_CHECK(alloc.allocated, "free of a request that holds no blocks (double free?)");
  // Reverse order: the tail of a sequence is the least likely to be shared, so it is evicted first.
  for (auto it = alloc.block_table.rbegin(); it != alloc.block_table.rend(); ++it) release_block(*it);
  for (int32_t s : alloc.state_slots) free_state_slots_.push_back(s);
  alloc = KVAllocation{};
}

int32_t BlockManager::take_free_block() {
  int32_t id;
  if (!free_uncached_.empty()) {
    id = free_uncached_.back();
    free_uncached_.pop_back();
  } else {
    PE_ASSERT(lru_size_ > 0);
    id = lru_head_;  // evict the least recently used cached block
    lru_remove(id);
    Block& b = blocks_[id];
    hash_to_block_.erase(b.hash, id);
    b.has_hash = false;
    checkpoints_.drop(id);
  }
  Block& b = blocks_[id];
  PE_ASSERT(b.ref_count == 0);
  b.ref_count = 1;
  return id;
}

void BlockManager::release_block(int32_t id) {
  Block& b = blocks_[id];
  PE_ASSERT(b.ref_count > 0);
  if (--b.ref_count > 0) return;
  if (b.has_hash)
    lru_push_back(id);
  else
    free_uncached_.push_back(id);
}

void BlockManager::lru_push_back(int32_t id) {
  Block& b = blocks_[id];
  b.lru_prev = lru_tail_;
  b.lru_next = -1;
  if (lru_tail_ >= 0) blocks_[lru_tail_].lru_next = id; else lru_head_ = id;
  lru_tail_ = id;
  b.in_lru = true;
  ++lru_size_;
}

void BlockManager::lru_remove(int32_t id) {
  Block& b = blocks_[id];
  PE_ASSERT(b.in_lru);
  if (b.lru_prev >= 0) blocks_[b.lru_prev].lru_next = b.lru_next; else lru_head_ = b.lru_next;
  if (b.lru_next >= 0) blocks_[b.lru_next].lru_prev = b.lru_prev; else lru_tail_ = b.lru_prev;
  b.lru_prev = b.lru_next = -1;
  b.in_lru = false;
  --lru_size_;
}

int32_t BlockManager::assign_checkpoint(const KVAllocation& alloc, int64_t index) {
  PE_CHECK(index >= 0 && index < static_cast<int64_t>(alloc.block_hashes.size()), "block ", index,
           " of the request has no published hash to checkpoint");
  // The block holding this hash: the request's own, or an earlier request's with the same content
  // (publish_hashes keeps the first).
  const int32_t id = hash_to_block_.find(alloc.block_hashes[index]);
  if (id < 0) return -1;
  if (checkpoints_.slot_of(id) >= 0) {
    checkpoints_.touch(id);
    return -1;
  }
  return checkpoints_.assign(id);
}

int32_t BlockManager::checkpoint_slot_of_block(int32_t id) const {
  PE_CHECK(id >= 0 && id < num_blocks(), "unknown block id ", id);
  return checkpoints_.slot_of(id);
}

int32_t BlockManager::ref_count(int32_t id) const {
  PE_CHECK(id >= 0 && id < num_blocks(), "unknown block id ", id);
  return blocks_[id].ref_count;
}

bool BlockManager::block_has_hash(int32_t id) const {
  PE_CHECK(id >= 0 && id < num_blocks(), "unknown block id ", id);
  return blocks_[id].has_hash;
}

std::vector<int32_t> BlockManager::block_tokens(int32_t id) const {
  PE_CHECK(id >= 0 && id < num_blocks(), "unknown block id ", id);
  if (!blocks_[id].has_hash) return {};
  return std::vector<int32_t>(tokens_of(id), tokens_of(id) + block_size_);
}

std::vector<int32_t> BlockManager::hashed_block_ids() const {
  std::vector<int32_t> ids;
  hash_to_block_.for_each([&](uint64_t, int32_t id) { ids.push_back(id); });
  std::sort(ids.begin(), ids.end());
  return ids;
}

void BlockManager::check_invariants(const std::vector<const KVAllocation*>& tables) const {
  PE_ASSERT(pending_hashes_.empty());
  std::vector<int32_t> refs(blocks_.size(), 0);
  std::vector<int32_t> slot_owner(num_state_slots_, 0);
  for (const KVAllocation* a : tables) {
    for (int32_t id : a->block_table) {
      PE_ASSERT(id >= 0 && id < num_blocks());
      ++refs[id];
    }
    for (int32_t s : a->state_slots) ++slot_owner[s];
  }
  // Past its hash watermark a table holds only private, unhashed blocks (append relies on this).
  for (const KVAllocation* a : tables)
    for (size_t i = a->num_hashed_blocks; i < a->block_table.size(); ++i) {
      const Block& b = blocks_[a->block_table[i]];
      PE_ASSERT(refs[a->block_table[i]] == 1 && !b.has_hash);
    }
  int64_t used = 0;
  for (size_t i = 0; i < blocks_.size(); ++i) {
    const Block& b = blocks_[i];
    PE_ASSERT(b.ref_count == refs[i]);
    if (b.ref_count > 0) ++used;
    PE_ASSERT(!(b.ref_count > 0 && b.in_lru));
    PE_ASSERT(b.in_lru == (b.ref_count == 0 && b.has_hash));
  }
  for (int32_t id : free_uncached_) PE_ASSERT(blocks_[id].ref_count == 0 && !blocks_[id].has_hash);
  PE_ASSERT(used + num_free_blocks() == num_blocks());
  size_t hashed = 0;
  for (const Block& b : blocks_) hashed += b.has_hash;
  PE_ASSERT(hashed == hash_to_block_.size());  // has_hash <=> the table points at the block
  hash_to_block_.for_each([&](uint64_t h, int32_t id) {
    const Block& b = blocks_[id];
    PE_ASSERT(b.has_hash && b.hash == h);
    PE_ASSERT(hash_block(b.parent_hash, tokens_of(id), b.salt) == h);
  });
  checkpoints_.check_invariants([&](int32_t id) { return blocks_[id].has_hash; });
  for (int32_t s : free_state_slots_) ++slot_owner[s];
  for (int32_t c : slot_owner) PE_ASSERT(c == 1);  // each slot: exactly one owner or the free pool
}

}  // namespace pyengine
