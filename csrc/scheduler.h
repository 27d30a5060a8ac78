// Continuous batching with chunked prefill, mixed prefill/decode batches, ragged draft tokens and
// preemption by recompute. schedule() returns flat arrays ready for the forward pass; update()
// commits what the sampler accepted.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <new>
#include <utility>
#include <unordered_map>
#include <vector>

#include "block_manager.h"
#include "sequence.h"

namespace pyengine {

struct SchedulerConfig {
  int32_t max_num_seqs = 256;
  int32_t max_num_batched_tokens = 8192;
  int32_t max_model_len = 2048;
  int32_t block_size = 16;
  int32_t num_kv_blocks = 1024;
  bool enable_prefix_caching = true;
  bool enable_chunked_prefill = true;
  int32_t num_spec_tokens = 0;    // k: the most drafts a row may carry
  int32_t drafter_lookahead = 0;  // KV positions a draft model writes past the verify tokens
  int32_t num_state_slots = 0;    // > 0 for hybrid models: each request holds 1 + k slots
};

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
  std::vector<int64_t> preempted_seq_ids;
  int32_t num_decode_rows = 0;
  int32_t max_query_len = 0;
  int32_t max_context_len = 0;

  int32_t num_rows() const { return static_cast<int32_t>(seq_ids.size()); }
};

struct UpdateResult {
  std::vector<int32_t> num_committed;  // tokens appended per row (after stop truncation)
  std::vector<int8_t> finish_reason;   // FinishReason per row; kNone = still running
};

struct SchedulerStats {
  int64_t num_steps = 0;
  int64_t num_preemptions = 0;
  int64_t prefix_cache_hit_tokens = 0;
  int64_t num_draft_tokens = 0;     // drafts verified
  int64_t num_accepted_tokens = 0;  // drafts accepted
  int64_t num_verify_rows = 0;      // decode rows that carried at least one draft
  int64_t num_verify_committed = 0; // tokens those rows committed, bonus included
  std::vector<int64_t> accepted_per_position;  // [k]
  std::vector<int64_t> drafted_per_position;   // [k]
};

class Scheduler {
 public:
  explicit Scheduler(const SchedulerConfig& config);

  void add_request(int64_t seq_id, std::vector<int32_t> prompt, int64_t max_tokens,
                   std::vector<int32_t> eos_token_ids, std::vector<int32_t> stop_token_ids,
                   bool ignore_eos, int64_t cache_salt);
  void abort_request(int64_t seq_id);
  // Drafts for the next step (0..k per running decode request); replaces earlier proposals.
  void set_draft_tokens(int64_t seq_id, const int32_t* tokens, int64_t n);
  // Prompt-lookup proposals for every running decode request (see ngram_proposer.h).
  void propose_ngram(int32_t min_n, int32_t max_n, int32_t k);
  // Clamp of the drafts a request may still use: more would pass max_tokens or max_model_len.
  int64_t max_useful_drafts(const Sequence& seq) const;

  ScheduledBatch schedule();
  UpdateResult update(const int32_t* tokens, int64_t num_tokens, const int32_t* counts, int64_t num_rows);

  bool has_unfinished() const { return !running_.empty() || !waiting_.empty(); }
  int64_t num_running() const { return static_cast<int64_t>(running_.size()); }
  int64_t num_waiting() const { return static_cast<int64_t>(waiting_.size()); }
  const SchedulerStats& stats() const { return stats_; }
  const SchedulerConfig& config() const { return config_; }
  const BlockManager& block_manager() const { return block_manager_; }
  const Sequence& sequence(int64_t seq_id) const;
  std::vector<int64_t> running_ids() const;
  void check_invariants() const;

 private:
  struct Row {
    Sequence* seq;
    int32_t num_scheduled;
    int32_t num_drafts;
    bool is_decode;
  };

  Sequence& find(int64_t seq_id);
  void preempt(Sequence* seq);
  // Appends up to n accepted tokens, stopping at EOS / stop ids / max_tokens / max_model_len.
  int32_t commit_tokens(Sequence& seq, const int32_t* tokens, int32_t n);
  void finish(Sequence& seq, FinishReason reason);
  ScheduledBatch build_batch(const std::vector<Row>& rows) const;

  SchedulerConfig config_;
  BlockManager block_manager_;
  std::unordered_map<int64_t, std::unique_ptr<Sequence>> seqs_;
  std::deque<Sequence*> waiting_;
  std::vector<Sequence*> running_;  // admission order: preemption takes from the back
  std::vector<Row> in_flight_;      // rows of the last schedule(), until update()
  bool step_in_flight_ = false;
  SchedulerStats stats_;
};

}  // namespace pyengine
