#include "scheduler.h"

#include <algorithm>

namespace pyengine {

Scheduler::Scheduler(const SchedulerConfig& c)
    : config_(c),
      block_manager_(c.num_kv_blocks, c.block_size, c.enable_prefix_caching, c.num_state_slots,
                     c.num_state_slots > 0 ? 1 + c.num_spec_tokens : 0, c.num_state_checkpoints) {
  PE_CHECK(c.max_num_seqs > 0, "max_num_seqs must be positive, got ", c.max_num_seqs);
  PE_CHECK(c.max_num_batched_tokens > 0, "max_num_batched_tokens must be positive, got ",
           c.max_num_batched_tokens);
  PE_CHECK(c.max_model_len > 1, "max_model_len must be > 1, got ", c.max_model_len);
  PE_CHECK(c.num_spec_tokens >= 0 && c.drafter_lookahead >= 0, "num_spec_tokens and drafter_lookahead must be >= 0");
  PE_CHECK(c.enable_chunked_prefill || c.max_num_batched_tokens >= c.max_model_len,
           "without chunked prefill max_num_batched_tokens (", c.max_num_batched_tokens,
           ") must be >= max_model_len (", c.max_model_len, ")");
  PE_CHECK(c.num_state_checkpoints >= 0, "num_state_checkpoints must be >= 0, got ", c.num_state_checkpoints);
  PE_CHECK(!checkpoints_states() || (c.state_checkpoint_interval > 0 && c.state_checkpoint_interval % c.block_size == 0),
           "state_checkpoint_interval (", c.state_checkpoint_interval, ") must be a positive multiple of block_size (",
           c.block_size, ")");
  verify_rows_by_drafts_.assign(c.num_spec_tokens + 1, 0);
  verify_rows_by_accepted_.assign(c.num_spec_tokens + 1, 0);
  draft_matrix_.assign(static_cast<size_t>(c.max_num_seqs) * c.num_spec_tokens, 0);
  for (int32_t slot = c.max_num_seqs - 1; slot >= 0; --slot) free_slots_.push_back(slot);
  in_flight_.reserve(c.max_num_seqs);  // a step has at most max_num_seqs rows: no reallocation
  filled_.reserve(c.max_num_seqs);
}

Sequence& Scheduler::find(int64_t seq_id) {
  auto it = seqs_.find(seq_id);
  PE_CHECK(it != seqs_.end(), "unknown request id ", seq_id);
  return *it->second;
}

const Sequence& Scheduler::sequence(int64_t seq_id) const {
  auto it = seqs_.find(seq_id);
  PE_CHECK(it != seqs_.end(), "unknown request id ", seq_id);
  return *it->second;
}

void Scheduler::add_request(int64_t seq_id, std::vector<int32_t> prompt, int64_t max_tokens,
                            std::vector<int32_t> eos_token_ids, std::vector<int32_t> stop_token_ids,
                            bool ignore_eos, int64_t cache_salt, bool has_stop_strings) {
  PE_CHECK(!seqs_.count(seq_id), "request id ", seq_id, " is already in use");
  PE_CHECK(!prompt.empty(), "request ", seq_id, ": the prompt is empty");
  PE_CHECK(max_tokens >= 1, "request ", seq_id, ": max_tokens must be >= 1, got ", max_tokens);
  const int64_t len = static_cast<int64_t>(prompt.size());
  PE_CHECK(len + max_tokens <= config_.max_model_len, "request ", seq_id, ": prompt (", len,
           " tokens) + max_tokens (", max_tokens, ") exceeds max_model_len (", config_.max_model_len, ")");
  // A request that could not run even with the whole pool to itself would wait forever. Drafts
  // never need more: they are clamped to the tokens a request may still commit, and dropped when
  // blocks run out (a draft model's own lookahead still needs its blocks).
  const int64_t worst = ceil_div(len + max_tokens + config_.drafter_lookahead, config_.block_size);
  PE_CHECK(worst <= config_.num_kv_blocks, "request ", seq_id, " may need ", worst,
           " KV blocks but the pool has only ", config_.num_kv_blocks);
  auto seq = std::make_unique<Sequence>();
  seq->seq_id = seq_id;
  seq->token_ids = std::move(prompt);
  seq->token_ids.reserve(len + max_tokens);  // commits never reallocate on the step path
  seq->num_prompt_tokens = len;
  seq->max_tokens = max_tokens;
  seq->stop_token_ids = std::move(stop_token_ids);
  if (!ignore_eos)
    seq->stop_token_ids.insert(seq->stop_token_ids.end(), eos_token_ids.begin(), eos_token_ids.end());
  seq->only_length_stops = seq->stop_token_ids.empty() && !has_stop_strings;
  seq->cache_salt = cache_salt;
  waiting_.push_back(seq.get());
  seqs_.emplace(seq_id, std::move(seq));
}

void Scheduler::abort_request(int64_t seq_id) {
  PE_CHECK(!step_in_flight_, "abort_request between schedule() and update()");
  finish(find(seq_id), FinishReason::kAbort);
  seqs_.erase(seq_id);
}

int64_t Scheduler::admission_lookahead(const Sequence& seq) const {
  // The first verify step's tokens (1 + drafts, drafts clamped like max_useful_drafts) and the
  // draft model's lookahead: reserving them at admission means that step never preempts.
  return 1 + max_useful_drafts(seq) + config_.drafter_lookahead;
}

std::shared_ptr<DecodeView> Scheduler::decode_view() const {
  auto view = std::make_shared<DecodeView>();
  view->num_waiting = num_waiting();
  for (const Sequence* seq : running_) {
    const int64_t left = tokens_left(*seq);
    const int64_t fewest = seq->only_length_stops ? left : 1;
    view->max_fewest_tokens_left = std::max(view->max_fewest_tokens_left, fewest);
    if (!seq->is_decode()) continue;
    view->seq_ids.push_back(seq->seq_id);
    view->request_slots.push_back(seq->slot);
    view->num_tokens.push_back(seq->num_tokens());
    view->tokens_left.push_back(left);
  }
  return view;
}

void Scheduler::leave_running(Sequence& seq) {
  block_manager_.free(seq.kv);
  running_.erase(std::find(running_.begin(), running_.end(), &seq));
  free_slots_.push_back(seq.slot);
  seq.slot = -1;
  seq.num_drafts = 0;
}

void Scheduler::preempt(Sequence* seq) {
  // Recompute: the request keeps every committed token and re-prefills them when readmitted.
  leave_running(*seq);
  seq->num_computed = 0;
  seq->num_accepted_last = 1;
  seq->status = SeqStatus::kWaiting;
  waiting_.push_front(seq);
  ++stats_.num_preemptions;
}

std::shared_ptr<ScheduledBatch> Scheduler::schedule() {
  PE_CHECK(!step_in_flight_, "schedule() called twice without update()");
  std::shared_ptr<ScheduledBatch> batch = reusable_batch();
  std::vector<Row>& rows = in_flight_;  // kept for update(); reuses last step's capacity
  rows.clear();
  std::vector<int64_t>& preempted = batch->preempted_seq_ids;
  preempted.clear();
  batch->state_copies.swap(pending_state_saves_);  // the last update()'s checkpoint saves run first
  pending_state_saves_.clear();
  batch->state_copy_slots.swap(pending_state_save_slots_);
  pending_state_save_slots_.clear();
  batch->num_state_saves = static_cast<int32_t>(batch->state_copies.size() / 4);
  int64_t budget = config_.max_num_batched_tokens;
  int64_t num_decode = 0;
  for (const Sequence* s : running_) num_decode += s->is_decode();
  // Every decode row gets its one token before any row gets a draft: drafts are trimmed first.
  int64_t draft_budget = std::max<int64_t>(0, budget - num_decode);
  const bool has_prefills = num_decode < static_cast<int64_t>(running_.size());  // else skip pass 2

  // Pass 1: running decode/verify rows, oldest first; preempt the newest when blocks run out.
  for (size_t i = 0; i < running_.size(); ++i) {
    Sequence* seq = running_[i];
    if (!seq->is_decode()) continue;
    if (budget < 1) break;
    int64_t drafts = std::min<int64_t>(seq->num_drafts, draft_budget);
    // The next step's positions, reserved now where free (a step launched ahead): a decode
    // step's one (async decode), or under speculation a verify step's 1 + k (verify ahead).
    int64_t ahead = 0;
    if (config_.decode_lookahead && config_.drafter_lookahead == 0)
      ahead = std::clamp<int64_t>(tokens_left(*seq) - 1 - drafts, 0, 1 + config_.num_spec_tokens);
    bool self_preempted = false;
    while (!block_manager_.can_append(seq->kv, seq->num_computed, 1 + drafts + config_.drafter_lookahead + ahead)) {
      if (ahead > 0) {  // optional, like drafts
        ahead = 0;
        continue;
      }
      if (drafts > 0) {  // drafts are optional: drop them before taking blocks from anyone
        drafts = 0;
        continue;
      }
      Sequence* victim = running_.back();
      preempted.push_back(victim->seq_id);
      preempt(victim);
      if (victim == seq) {
        self_preempted = true;
        break;
      }
    }
    if (self_preempted) break;  // seq was the newest: nothing after it is running any more
    block_manager_.append(seq->kv, seq->num_computed, 1 + drafts + config_.drafter_lookahead + ahead);
    const auto d = static_cast<int32_t>(drafts);
    seq->num_drafts = d;
    rows.push_back({seq, 1 + d, d, 1 + d, seq->slot, true});
    budget -= 1 + drafts;
    draft_budget -= drafts;
  }
  const int32_t num_decode_rows = static_cast<int32_t>(rows.size());

  // Pass 2: running prefills (chunked continuations). Admission reserved their blocks.
  for (size_t i = 0; has_prefills && i < running_.size() && budget > 0; ++i) {
    Sequence* seq = running_[i];
    if (seq->is_decode()) continue;
    const int64_t remaining = seq->num_tokens() - seq->num_computed;
    const int64_t chunk = prefill_chunk(*seq, budget);
    if (!config_.enable_chunked_prefill && chunk < remaining) continue;
    PE_ASSERT(block_manager_.blocks_needed(seq->kv, seq->num_computed + chunk) == 0);
    rows.push_back({seq, static_cast<int32_t>(chunk), 0, chunk == remaining, seq->slot, false});
    budget -= chunk;
  }

  // Pass 3: admit waiting requests, first come first served, unless this step had to preempt.
  while (preempted.empty() && !waiting_.empty() && budget > 0 &&
         static_cast<int64_t>(running_.size()) < config_.max_num_seqs) {
    Sequence* seq = waiting_.front();
    if (!config_.enable_chunked_prefill && seq->num_tokens() > budget) break;
    const int64_t lookahead = admission_lookahead(*seq);
    if (!block_manager_.can_allocate(seq->token_ids.data(), seq->num_tokens(), lookahead, seq->cache_salt))
      break;
    int64_t cached = block_manager_.allocate(seq->kv, seq->token_ids.data(), seq->num_tokens(),
                                             lookahead, seq->cache_salt);
    // Room for every block the request can ever hold: appends never reallocate on the step path.
    const int64_t max_len = seq->num_prompt_tokens + seq->max_tokens + lookahead - 1;
    seq->kv.block_table.reserve(ceil_div(max_len, config_.block_size));
    stats_.prefix_cache_hit_tokens += cached;
    stats_.prefix_cache_query_tokens += seq->num_tokens();
    if (cached > 0 && checkpoints_states()) {  // resume from the state at the end of the last hit block
      const int32_t src = block_manager_.restore_slot(seq->kv, cached / config_.block_size);
      batch->state_copies.insert(batch->state_copies.end(), {src, src, 0, seq->kv.state_slots[0]});
      batch->state_copy_slots.push_back(src);
      batch->state_copy_slots.resize(batch->state_copy_slots.size() + seq->kv.state_slots.size() - 1, -1);
      ++stats_.num_state_restores;
    }
    seq->num_computed = cached;
    seq->num_accepted_last = 1;
    seq->status = SeqStatus::kRunning;
    PE_ASSERT(!free_slots_.empty());  // running_.size() < max_num_seqs
    seq->slot = free_slots_.back();
    free_slots_.pop_back();
    waiting_.pop_front();
    running_.push_back(seq);
    const int64_t remaining = seq->num_tokens() - cached;
    const int64_t chunk = prefill_chunk(*seq, budget);
    rows.push_back({seq, static_cast<int32_t>(chunk), 0, chunk == remaining, seq->slot, false});
    budget -= chunk;
  }

  build_batch(rows, *batch);
  batch->num_decode_rows = num_decode_rows;
  step_in_flight_ = true;
  ++stats_.num_steps;
  return batch;
}

int32_t Scheduler::commit_tokens(Sequence& seq, const int32_t* tokens, int32_t n, FinishReason& finish_reason) {
  // Accepted tokens count one by one: a stop inside the run ends it there and drops the rest.
  const int64_t room = tokens_left(seq);
  const int32_t limit = static_cast<int32_t>(std::min<int64_t>(n, room));
  int32_t m = limit;
  FinishReason reason = limit < n || limit == room ? FinishReason::kLength : FinishReason::kNone;
  const std::vector<int32_t>& stops = seq.stop_token_ids;
  if (!stops.empty()) {
    for (int32_t j = 0; j < limit; ++j) {
      if (std::find(stops.begin(), stops.end(), tokens[j]) != stops.end()) {
        m = j + 1;
        reason = FinishReason::kStop;
        break;
      }
    }
  }
  seq.token_ids.insert(seq.token_ids.end(), tokens, tokens + m);
  finish_reason = reason;
  return m;
}

void Scheduler::finish(Sequence& seq, FinishReason reason) {
  if (seq.status == SeqStatus::kRunning)
    leave_running(seq);
  else if (seq.status == SeqStatus::kWaiting)
    waiting_.erase(std::find(waiting_.begin(), waiting_.end(), &seq));
  seq.status = SeqStatus::kFinished;
  seq.finish_reason = reason;
}

UpdateResult Scheduler::update(const int32_t* tokens, int64_t num_tokens, const int32_t* counts,
                               int64_t num_rows) {
  PE_CHECK(step_in_flight_, "update() without a preceding schedule()");
  PE_CHECK(num_rows == static_cast<int64_t>(in_flight_.size()), "update() got ", num_rows,
           " rows, the step scheduled ", in_flight_.size());
  // Validate everything before mutating anything, so a bad call leaves the scheduler intact.
  int64_t total = 0;
  for (int64_t i = 0; i < num_rows; ++i) {
    const Row& r = in_flight_[i];
    const int64_t c = counts[i];
    if (r.is_decode) {
      PE_CHECK(c >= 1 && c <= 1 + r.num_drafts, "row ", i, ": ", c, " tokens for a step with ",
               r.num_drafts, " drafts (expected 1..", 1 + r.num_drafts, ")");
      const int32_t* drafts = draft_row(r.slot);
      for (int64_t j = 0; j + 1 < c; ++j)
        PE_CHECK(tokens[total + j] == drafts[j], "row ", i, ": accepted token ", j,
                 " differs from the draft it accepts");
    } else {
      PE_CHECK(c == r.num_logits, "row ", i, ": a prefill chunk commits ", r.num_logits, " tokens, got ", c);
    }
    total += c;
  }
  PE_CHECK(total == num_tokens, "update() got ", num_tokens, " tokens, counts add up to ", total);

  UpdateResult res;
  finished_outputs_.seq_ids.clear();
  finished_outputs_.cu_num_tokens.assign(1, 0);
  finished_outputs_.token_ids.clear();
  res.num_committed.resize(num_rows);
  res.finish_reason.resize(num_rows);
  step_in_flight_ = false;
  int64_t off = 0;
  for (int64_t i = 0; i < num_rows; ++i) {
    const Row& r = in_flight_[i];
    Sequence& seq = *r.seq;
    const int32_t c = counts[i];
    if (r.num_drafts > 0) {  // a verify row
      ++stats_.num_verify_rows;
      stats_.num_verify_committed += c;
      stats_.num_draft_tokens += r.num_drafts;
      stats_.num_accepted_tokens += c - 1;
      ++verify_rows_by_drafts_[r.num_drafts];
      ++verify_rows_by_accepted_[c - 1];
    }
    // KV is valid for the inputs that were committed tokens: a prefill chunk entirely, a verify
    // row's last committed token plus its accepted drafts. Rejected slots are overwritten later.
    const int64_t old_num_computed = seq.num_computed;
    seq.num_computed += r.is_decode ? c : r.num_scheduled;
    seq.num_accepted_last = r.is_decode ? c : 1;
    seq.num_drafts = 0;
    FinishReason reason = FinishReason::kNone;
    res.num_committed[i] = commit_tokens(seq, tokens + off, c, reason);
    res.finish_reason[i] = static_cast<int8_t>(reason);
    off += c;
    // A finishing request keeps its blocks until its last full blocks (and states) are cached too:
    // the blocks a step fills do not depend on how many tokens the step committed.
    if (reason != FinishReason::kNone) finishing_.push_back({&seq, reason});
    if (block_manager_.has_new_full_block(seq.kv, std::min(seq.num_computed, seq.num_tokens())))
      filled_.push_back(&seq);
    if (checkpoints_states()) queue_checkpoints(r, old_num_computed);
  }
  // Prefix caching, in a loop of its own: the hash chains of different requests and their block
  // table reads are independent, so they overlap here instead of stalling the loop above.
  for (const Sequence* seq : filled_) {  // start the loads the hashing waits for, all at once
    __builtin_prefetch(&seq->kv.last_block_hash);
    __builtin_prefetch(seq->kv.block_table.data() + seq->kv.num_hashed_blocks);
  }
  for (Sequence* seq : filled_) {
    const int64_t num_valid = std::min(seq->num_computed, seq->num_tokens());  // written and committed
    block_manager_.hash_full_blocks(seq->kv, seq->token_ids.data(), num_valid);
  }
  block_manager_.publish_hashes();
  filled_.clear();
  // Checkpoints attach to published hashes, so they are assigned after publishing.
  for (const CheckpointCandidate& c : checkpoint_candidates_) {
    const int32_t dst = block_manager_.assign_checkpoint(c.seq->kv, c.block_index);
    if (dst < 0) continue;
    pending_state_saves_.insert(pending_state_saves_.end(), {c.ssm_slot, c.conv_line, c.conv_offset, dst});
    const std::vector<int32_t>& slots = c.seq->kv.state_slots;
    pending_state_save_slots_.insert(pending_state_save_slots_.end(), slots.begin(), slots.end());
    ++stats_.num_state_checkpoints_saved;
  }
  checkpoint_candidates_.clear();
  for (const auto& [seq, reason] : finishing_) {
    finish(*seq, reason);
    finished_outputs_.seq_ids.push_back(seq->seq_id);
    finished_outputs_.token_ids.insert(finished_outputs_.token_ids.end(),
                                       seq->token_ids.begin() + seq->num_prompt_tokens, seq->token_ids.end());
    finished_outputs_.cu_num_tokens.push_back(static_cast<int64_t>(finished_outputs_.token_ids.size()));
    seqs_.erase(seq->seq_id);  // finish() freed its blocks; nothing reads it any more
  }
  finishing_.clear();
  in_flight_.clear();
  return res;
}

SchedulerStats Scheduler::stats() const {
  // Per draft position j: verify rows that carried a draft at j, and rows that accepted it.
  SchedulerStats st = stats_;
  const int32_t k = config_.num_spec_tokens;
  st.drafted_per_position.assign(k, 0);
  st.accepted_per_position.assign(k, 0);
  int64_t drafted = 0, accepted = 0;
  for (int32_t j = k - 1; j >= 0; --j) {
    drafted += verify_rows_by_drafts_[j + 1];
    accepted += verify_rows_by_accepted_[j + 1];
    st.drafted_per_position[j] = drafted;
    st.accepted_per_position[j] = accepted;
  }
  return st;
}

std::vector<int64_t> Scheduler::running_ids() const {
  std::vector<int64_t> ids;
  for (const Sequence* s : running_) ids.push_back(s->seq_id);
  return ids;
}

void Scheduler::check_invariants() const {
  std::vector<const KVAllocation*> tables;
  std::vector<int32_t> slot_owners(config_.max_num_seqs, 0);
  for (const Sequence* s : running_) {
    PE_ASSERT(s->kv.allocated && s->status == SeqStatus::kRunning);
    PE_ASSERT(s->num_computed <= s->num_tokens());
    PE_ASSERT(s->slot >= 0 && s->slot < config_.max_num_seqs && slot_owners[s->slot] == 0);
    slot_owners[s->slot] = 1;
    PE_ASSERT(s->num_drafts >= 0 && s->num_drafts <= config_.num_spec_tokens);
    tables.push_back(&s->kv);
  }
  for (const Sequence* s : waiting_)
    PE_ASSERT(!s->kv.allocated && s->num_computed == 0 && s->slot < 0 && s->num_drafts == 0);
  PE_ASSERT(running_.size() + free_slots_.size() == static_cast<size_t>(config_.max_num_seqs));
  block_manager_.check_invariants(tables);
}

}  // namespace pyengine
