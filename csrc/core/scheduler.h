// Continuous batching with chunked prefill, mixed prefill/decode batches, ragged draft tokens and
// preemption by recompute. schedule() returns flat arrays ready for the forward pass; update()
// commits what the sampler accepted.
#pragma once

#include <algorithm>
#include <cstdint>
#include <deque>
#include <memory>
#include <unordered_map>
#include <vector>

#include "block_manager.h"
#include "decode_view.h"
#include "scheduled_batch.h"
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
  // Async decode: a decode row also gets the blocks of the next step's positions where they are
  // free (never by preempting; 1 + num_spec_tokens of them under speculation with a host-side
  // proposer: a verify step launched ahead), so a step launched ahead finds its slots in the table.
  bool decode_lookahead = false;
  int32_t num_state_slots = 0;    // > 0 for hybrid models: each request holds 1 + k slots
  // Hybrid models with prefix caching: the recurrent state at every position that is a multiple of
  // state_checkpoint_interval (a multiple of block_size) is kept, in a pool of
  // num_state_checkpoints slots, with the hash of the block ending there; prefill chunks end at
  // those positions so that the state there exists.
  int32_t num_state_checkpoints = 0;
  int32_t state_checkpoint_interval = 0;
};

struct UpdateResult {
  std::vector<int32_t> num_committed;  // tokens appended per row (after stop truncation)
  std::vector<int8_t> finish_reason;   // FinishReason per row; kNone = still running
};

// The output tokens of the requests the last update() finished, concatenated: request i's are
// token_ids[cu_num_tokens[i], cu_num_tokens[i + 1]). The engine reads a request's output once,
// here, instead of appending every step's tokens to a Python list per row.
struct FinishedOutputs {
  std::vector<int64_t> seq_ids;
  std::vector<int64_t> cu_num_tokens{0};
  std::vector<int32_t> token_ids;
};

struct SchedulerStats {
  int64_t num_steps = 0;
  int64_t num_preemptions = 0;
  int64_t prefix_cache_hit_tokens = 0;
  int64_t prefix_cache_query_tokens = 0;  // tokens of the requests admitted (hit rate: hits / these)
  int64_t num_state_checkpoints_saved = 0;
  int64_t num_state_restores = 0;
  int64_t num_draft_tokens = 0;     // drafts verified
  int64_t num_accepted_tokens = 0;  // drafts accepted
  int64_t num_verify_rows = 0;      // decode rows that carried at least one draft
  int64_t num_verify_committed = 0; // tokens those rows committed, bonus included
  std::vector<int64_t> accepted_per_position;  // [k]: verify rows that accepted draft j
  std::vector<int64_t> drafted_per_position;   // [k]: verify rows that carried draft j
};

class Scheduler {
 public:
  explicit Scheduler(const SchedulerConfig& config);

  void add_request(int64_t seq_id, std::vector<int32_t> prompt, int64_t max_tokens,
                   std::vector<int32_t> eos_token_ids, std::vector<int32_t> stop_token_ids,
                   bool ignore_eos, int64_t cache_salt, bool has_stop_strings = false);
  void abort_request(int64_t seq_id);
  // Drafts for the next step (0..k per running decode request); replaces earlier proposals.
  void set_draft_tokens(int64_t seq_id, const int32_t* tokens, int64_t n);
  // The same for num_seqs requests at once: counts[i] drafts each, concatenated in tokens.
  void set_draft_tokens_batch(const int64_t* seq_ids, const int32_t* counts, int64_t num_seqs,
                              const int32_t* tokens, int64_t num_tokens);
  // Prompt-lookup proposals (see ngram_proposer.h) for num_seqs running decode requests, up to
  // max_drafts[i] each (clamped to max_useful_drafts); the others keep theirs.
  void propose_ngram(int32_t min_n, int32_t max_n, const int64_t* seq_ids, const int32_t* max_drafts,
                     int64_t num_seqs);
  // Tokens a request may still commit: max_tokens and max_model_len both bound it.
  int64_t tokens_left(const Sequence& seq) const {
    return std::min(seq.max_tokens - seq.num_output_tokens(),
                    static_cast<int64_t>(config_.max_model_len) - seq.num_tokens());
  }
  // Clamp of the drafts a request may still use: more would pass max_tokens or max_model_len.
  int64_t max_useful_drafts(const Sequence& seq) const;
  // Positions past the prompt that admission reserves blocks for.
  int64_t admission_lookahead(const Sequence& seq) const;
  // The running requests whose next step decodes (see decode_view.h).
  std::shared_ptr<DecodeView> decode_view() const;

  // The batch is the caller's until it drops its last reference; the scheduler then reuses it.
  std::shared_ptr<ScheduledBatch> schedule();
  // Draft values that arrive after schedule() (a proposer that kept them on the device while the
  // step was launched; it set placeholders): the in-flight step's verify rows take them, n in
  // batch order (row r's num_draft_tokens[r] from cu_num_draft_tokens[r]), both in the draft rows
  // update() checks accepted tokens against and in the batch's input ids.
  void fill_drafts(ScheduledBatch& batch, const int32_t* tokens, int64_t n);
  UpdateResult update(const int32_t* tokens, int64_t num_tokens, const int32_t* counts, int64_t num_rows);
  const FinishedOutputs& finished_outputs() const { return finished_outputs_; }

  bool has_unfinished() const { return !running_.empty() || !waiting_.empty(); }
  int64_t num_running() const { return static_cast<int64_t>(running_.size()); }
  int64_t num_waiting() const { return static_cast<int64_t>(waiting_.size()); }
  SchedulerStats stats() const;
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
    int32_t num_logits;  // 1 + drafts (decode), 1 (last prefill chunk), 0 (partial chunk)
    int32_t slot;        // seq->slot: update() validates against the drafts without touching seq
    bool is_decode;
  };

  Sequence& find(int64_t seq_id);
  // seq_ids[i] of a list in running order: running_[i] when it matches, else the hash lookup.
  Sequence& find_running(int64_t seq_id, int64_t i);
  // Row `slot` of the draft matrix: the drafts of the running request holding that slot.
  int32_t* draft_row(int32_t slot) {
    return draft_matrix_.data() + static_cast<size_t>(slot) * config_.num_spec_tokens;
  }
  const int32_t* draft_row(int32_t slot) const {
    return draft_matrix_.data() + static_cast<size_t>(slot) * config_.num_spec_tokens;
  }
  void leave_running(Sequence& seq);  // removes seq from running_, frees its blocks and slot
  void set_draft_tokens(Sequence& seq, const int32_t* tokens, int64_t n);
  void preempt(Sequence* seq);
  // Appends up to n accepted tokens, stopping at EOS / stop ids / max_tokens / max_model_len.
  // The finish reason (kNone: still running) goes to finish_reason; update() finishes the request
  // after caching its blocks.
  int32_t commit_tokens(Sequence& seq, const int32_t* tokens, int32_t n, FinishReason& finish_reason);
  void finish(Sequence& seq, FinishReason reason);
  // Tokens of a prefill chunk from seq.num_computed within `budget`: it ends at the prompt's end or
  // at the next state checkpoint position, whichever comes first.
  int64_t prefill_chunk(const Sequence& seq, int64_t budget) const;
  // update(): the states this step left at checkpoint positions of `row` (still running).
  void queue_checkpoints(const Row& row, int64_t old_num_computed);
  bool checkpoints_states() const { return block_manager_.num_state_checkpoints() > 0; }
  std::shared_ptr<ScheduledBatch> reusable_batch();                              // scheduler_batch.cpp
  void build_batch(const std::vector<Row>& rows, ScheduledBatch& batch) const;  // scheduler_batch.cpp

  SchedulerConfig config_;
  BlockManager block_manager_;
  std::unordered_map<int64_t, std::unique_ptr<Sequence>> seqs_;
  std::deque<Sequence*> waiting_;
  std::vector<Sequence*> running_;  // admission order: preemption takes from the back
  // Drafts of the running requests: row Sequence::slot of a max_num_seqs x k matrix, so that the
  // step path reads and writes one dense array instead of a buffer per request.
  std::vector<int32_t> draft_matrix_;
  std::vector<int32_t> free_slots_;
  std::vector<Row> in_flight_;      // rows of the last schedule(), until update()
  std::vector<Sequence*> filled_;   // update(): requests whose step filled a block to hash
  std::vector<std::pair<Sequence*, FinishReason>> finishing_;  // update(): finished once hashed
  // Recurrent-state copies for the next batch (ScheduledBatch::state_copies): the checkpoints
  // update() assigned, which the next forward saves before anything runs.
  std::vector<int32_t> pending_state_saves_;
  std::vector<int32_t> pending_state_save_slots_;  // ScheduledBatch::state_copy_slots of those saves
  struct CheckpointCandidate {  // a state at a checkpoint position, waiting for its block's hash
    Sequence* seq;
    int64_t block_index;
    int32_t ssm_slot, conv_line, conv_offset;
  };
  std::vector<CheckpointCandidate> checkpoint_candidates_;
  FinishedOutputs finished_outputs_;  // of the last update()
  static constexpr size_t kBatchPoolSize = 3;
  std::vector<std::shared_ptr<ScheduledBatch>> batch_pool_;  // batches schedule() refills
  bool step_in_flight_ = false;
  SchedulerStats stats_;  // the per-position vectors are derived by stats() from:
  std::vector<int64_t> verify_rows_by_drafts_;    // [k + 1]: verify rows by draft count
  std::vector<int64_t> verify_rows_by_accepted_;  // [k + 1]: verify rows by accepted drafts
};

}  // namespace pyengine
