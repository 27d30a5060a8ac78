#include "scheduler.h"

#include <algorithm>

#include "ngram_proposer.h"

namespace pyengine {

Scheduler::Scheduler(const SchedulerConfig& c)
    : config_(c),
      block_manager_(c.num_kv_blocks, c.block_size, c.enable_prefix_caching, c.num_state_slots,
                     c.num_state_slots > 0 ? 1 + c.num_spec_tokens : 0) {
  PE_CHECK(c.max_num_seqs > 0, "max_num_seqs must be positive, got ", c.max_num_seqs);
  PE_CHECK(c.max_num_batched_tokens > 0, "max_num_batched_tokens must be positive, got ",
           c.max_num_batched_tokens);
  PE_CHECK(c.max_model_len > 1, "max_model_len must be > 1, got ", c.max_model_len);
  PE_CHECK(c.num_spec_tokens >= 0 && c.drafter_lookahead >= 0, "num_spec_tokens and drafter_lookahead must be >= 0");
  PE_CHECK(c.enable_chunked_prefill || c.max_num_batched_tokens >= c.max_model_len,
           "without chunked prefill max_num_batched_tokens (", c.max_num_batched_tokens,
           ") must be >= max_model_len (", c.max_model_len, ")");
  stats_.accepted_per_position.assign(c.num_spec_tokens, 0);
  stats_.drafted_per_position.assign(c.num_spec_tokens, 0);
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
                            bool ignore_eos, int64_t cache_salt) {
  PE_CHECK(!seqs_.count(seq_id), "request id ", seq_id, " is already in use");
  PE_CHECK(!prompt.empty(), "request ", seq_id, ": the prompt is empty");
  PE_CHECK(max_tokens >= 1, "request ", seq_id, ": max_tokens must be >= 1, got ", max_tokens);
  const int64_t len = static_cast<int64_t>(prompt.size());
  PE_CHECK(len + max_tokens <= config_.max_model_len, "request ", seq_id, ": prompt (", len,
           " tokens) + max_tokens (", max_tokens, ") exceeds max_model_len (", config_.max_model_len, ")");
  // A request that could not run even with the whole pool to itself would wait forever.
  const int64_t worst = ceil_div(len + max_tokens + config_.num_spec_tokens + config_.drafter_lookahead,
                                 config_.block_size);
  PE_CHECK(worst <= config_.num_kv_blocks, "request ", seq_id, " may need ", worst,
           " KV blocks but the pool has only ", config_.num_kv_blocks);
  auto seq = std::make_unique<Sequence>();
  seq->seq_id = seq_id;
  seq->token_ids = std::move(prompt);
  seq->token_ids.reserve(len + max_tokens);  // commits never reallocate on the step path
  seq->num_prompt_tokens = len;
  seq->max_tokens = max_tokens;
  seq->eos_token_ids = std::move(eos_token_ids);
  seq->stop_token_ids = std::move(stop_token_ids);
  seq->ignore_eos = ignore_eos;
  seq->cache_salt = cache_salt;
  waiting_.push_back(seq.get());
  seqs_.emplace(seq_id, std::move(seq));
}

void Scheduler::abort_request(int64_t seq_id) {
  PE_CHECK(!step_in_flight_, "abort_request between schedule() and update()");
  finish(find(seq_id), FinishReason::kAbort);
  seqs_.erase(seq_id);
}

int64_t Scheduler::max_useful_drafts(const Sequence& seq) const {
  // A verify step commits up to drafts + 1 tokens; drafts past the stop limits are wasted work.
  int64_t left = std::min(seq.max_tokens - seq.num_output_tokens(),
                          static_cast<int64_t>(config_.max_model_len) - seq.num_tokens());
  return std::max<int64_t>(0, std::min<int64_t>(config_.num_spec_tokens, left - 1));
}

void Scheduler::set_draft_tokens(int64_t seq_id, const int32_t* tokens, int64_t n) {
  Sequence& seq = find(seq_id);
  PE_CHECK(n >= 0 && n <= config_.num_spec_tokens, "request ", seq_id, ": ", n,
           " drafts exceed num_spec_tokens (", config_.num_spec_tokens, ")");
  PE_CHECK(seq.status == SeqStatus::kRunning && seq.is_decode(), "request ", seq_id,
           " is not in a decode step and cannot take drafts");
  n = std::min(n, max_useful_drafts(seq));
  seq.draft_tokens.assign(tokens, tokens + n);
}

void Scheduler::propose_ngram(int32_t min_n, int32_t max_n, int32_t k) {
  PE_CHECK(min_n >= 1 && max_n >= min_n, "ngram sizes need 1 <= min_n <= max_n, got ", min_n, "..", max_n);
  k = std::min(k, config_.num_spec_tokens);
  std::vector<int32_t> buf(std::max(k, 0));
  for (Sequence* seq : running_) {
    if (!seq->is_decode()) continue;
    int64_t limit = std::min<int64_t>(k, max_useful_drafts(*seq));
    int64_t n = propose_ngram_tokens(seq->token_ids.data(), seq->num_tokens(), min_n, max_n,
                                     static_cast<int32_t>(limit), buf.data());
    seq->draft_tokens.assign(buf.begin(), buf.begin() + n);
  }
}

void Scheduler::preempt(Sequence* seq) {
  // Recompute: the request keeps every committed token and re-prefills them when readmitted.
  block_manager_.free(seq->kv);
  seq->num_computed = 0;
  seq->num_accepted_last = 1;
  seq->draft_tokens.clear();
  seq->status = SeqStatus::kWaiting;
  running_.erase(std::find(running_.begin(), running_.end(), seq));
  waiting_.push_front(seq);
  ++stats_.num_preemptions;
}

ScheduledBatch Scheduler::schedule() {
  PE_CHECK(!step_in_flight_, "schedule() called twice without update()");
  std::vector<Row> rows;
  std::vector<int64_t> preempted;
  int64_t budget = config_.max_num_batched_tokens;
  int64_t num_decode = 0;
  for (Sequence* s : running_) num_decode += s->is_decode();
  // Every decode row gets its one token before any row gets a draft: drafts are trimmed first.
  int64_t draft_budget = std::max<int64_t>(0, budget - num_decode);

  // Pass 1: running decode/verify rows, oldest first; preempt the newest when blocks run out.
  for (size_t i = 0; i < running_.size(); ++i) {
    Sequence* seq = running_[i];
    if (!seq->is_decode()) continue;
    if (budget < 1) break;
    int64_t drafts = std::min<int64_t>(seq->draft_tokens.size(), draft_budget);
    bool self_preempted = false;
    while (!block_manager_.can_append(seq->kv, seq->num_computed, 1 + drafts + config_.drafter_lookahead)) {
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
    block_manager_.append(seq->kv, seq->num_computed, 1 + drafts + config_.drafter_lookahead);
    seq->draft_tokens.resize(drafts);
    rows.push_back({seq, static_cast<int32_t>(1 + drafts), static_cast<int32_t>(drafts), true});
    budget -= 1 + drafts;
    draft_budget -= drafts;
  }
  const int32_t num_decode_rows = static_cast<int32_t>(rows.size());

  // Pass 2: running prefills (chunked continuations). Admission reserved their blocks.
  for (size_t i = 0; i < running_.size() && budget > 0; ++i) {
    Sequence* seq = running_[i];
    if (seq->is_decode()) continue;
    int64_t remaining = seq->num_tokens() - seq->num_computed;
    int64_t chunk = std::min(remaining, budget);
    if (!config_.enable_chunked_prefill && chunk < remaining) continue;
    PE_ASSERT(block_manager_.blocks_needed(seq->kv, seq->num_computed + chunk) == 0);
    rows.push_back({seq, static_cast<int32_t>(chunk), 0, false});
    budget -= chunk;
  }

  // Pass 3: admit waiting requests, first come first served, unless this step had to preempt.
  const int64_t lookahead = 1 + config_.num_spec_tokens + config_.drafter_lookahead;
  while (preempted.empty() && !waiting_.empty() && budget > 0 &&
         static_cast<int64_t>(running_.size()) < config_.max_num_seqs) {
    Sequence* seq = waiting_.front();
    if (!config_.enable_chunked_prefill && seq->num_tokens() > budget) break;
    if (!block_manager_.can_allocate(seq->token_ids.data(), seq->num_tokens(), lookahead, seq->cache_salt))
      break;
    int64_t cached = block_manager_.allocate(seq->kv, seq->token_ids.data(), seq->num_tokens(),
                                             lookahead, seq->cache_salt);
    stats_.prefix_cache_hit_tokens += cached;
    seq->num_computed = cached;
    seq->num_accepted_last = 1;
    seq->status = SeqStatus::kRunning;
    waiting_.pop_front();
    running_.push_back(seq);
    int64_t chunk = std::min(seq->num_tokens() - cached, budget);
    rows.push_back({seq, static_cast<int32_t>(chunk), 0, false});
    budget -= chunk;
  }

  ScheduledBatch batch = build_batch(rows);
  batch.num_decode_rows = num_decode_rows;
  batch.preempted_seq_ids = std::move(preempted);
  in_flight_ = std::move(rows);
  step_in_flight_ = true;
  ++stats_.num_steps;
  return batch;
}

ScheduledBatch Scheduler::build_batch(const std::vector<Row>& rows) const {
  // Sized once, filled through pointers: this runs every step over every scheduled token.
  ScheduledBatch b;
  const int32_t B = config_.block_size;
  const int32_t slots_per_seq = block_manager_.state_slots_per_seq();
  const size_t n = rows.size();
  int64_t num_tokens = 0, num_logits = 0;
  for (const Row& r : rows) {
    num_tokens += r.num_scheduled;
    const Sequence& s = *r.seq;
    num_logits += r.is_decode ? 1 + r.num_drafts : (s.num_computed + r.num_scheduled == s.num_tokens());
    b.max_blocks = std::max<int32_t>(b.max_blocks, static_cast<int32_t>(ceil_div(s.num_computed + r.num_scheduled, B)));
  }
  b.seq_ids.resize(n);
  b.input_ids.resize(num_tokens);
  b.positions.resize(num_tokens);
  b.slot_mapping.resize(num_tokens);
  b.query_start_loc.resize(n + 1);
  b.cu_num_draft_tokens.resize(n + 1);
  b.context_lens.resize(n);
  b.num_computed.resize(n);
  b.num_draft_tokens.resize(n);
  b.num_logits.resize(n);
  b.num_accepted_prev.resize(n);
  b.logits_indices.resize(num_logits);
  b.state_slots.resize(n * slots_per_seq);
  b.block_tables.resize(n * b.max_blocks);
  int64_t* ids = b.input_ids.data();
  int64_t* pos = b.positions.data();
  int64_t* slots = b.slot_mapping.data();
  int32_t* logits_idx = b.logits_indices.data();
  int32_t q = 0, drafts = 0;
  b.query_start_loc[0] = b.cu_num_draft_tokens[0] = 0;
  for (size_t i = 0; i < n; ++i) {
    const Row& r = rows[i];
    const Sequence& s = *r.seq;
    const int64_t start = s.num_computed, end = start + r.num_scheduled, committed = s.num_tokens();
    const int32_t* table = s.kv.block_table.data();
    for (int64_t p = start; p < end; ++p, ++q) {
      ids[q] = p < committed ? s.token_ids[p] : s.draft_tokens[p - committed];
      pos[q] = p;
      slots[q] = static_cast<int64_t>(table[p / B]) * B + p % B;
    }
    const int32_t ctx = static_cast<int32_t>(end), used = static_cast<int32_t>(ceil_div(ctx, B));
    int32_t* row_table = b.block_tables.data() + i * b.max_blocks;
    std::copy_n(table, used, row_table);
    std::fill(row_table + used, row_table + b.max_blocks, -1);
    const int32_t logits = r.is_decode ? 1 + r.num_drafts : (end == committed ? 1 : 0);
    for (int32_t j = 0; j < logits; ++j) *logits_idx++ = q - logits + j;
    drafts += r.num_drafts;
    b.seq_ids[i] = s.seq_id;
    b.query_start_loc[i + 1] = q;
    b.cu_num_draft_tokens[i + 1] = drafts;
    b.context_lens[i] = ctx;
    b.num_computed[i] = static_cast<int32_t>(start);
    b.num_draft_tokens[i] = r.num_drafts;
    b.num_logits[i] = logits;
    b.num_accepted_prev[i] = s.num_accepted_last;
    std::copy_n(s.kv.state_slots.data(), slots_per_seq, b.state_slots.data() + i * slots_per_seq);
    b.max_query_len = std::max(b.max_query_len, r.num_scheduled);
    b.max_context_len = std::max(b.max_context_len, ctx);
  }
  return b;
}

int32_t Scheduler::commit_tokens(Sequence& seq, const int32_t* tokens, int32_t n) {
  // Accepted tokens count one by one: a stop inside the run ends it there and drops the rest.
  const int64_t room = std::min(seq.max_tokens - seq.num_output_tokens(),
                                static_cast<int64_t>(config_.max_model_len) - seq.num_tokens());
  const int32_t limit = static_cast<int32_t>(std::min<int64_t>(n, room));
  int32_t m = limit;
  FinishReason reason = limit < n || limit == room ? FinishReason::kLength : FinishReason::kNone;
  auto in = [](const std::vector<int32_t>& v, int32_t t) { return std::find(v.begin(), v.end(), t) != v.end(); };
  if (!seq.stop_token_ids.empty() || (!seq.ignore_eos && !seq.eos_token_ids.empty())) {
    for (int32_t j = 0; j < limit; ++j) {
      if ((!seq.ignore_eos && in(seq.eos_token_ids, tokens[j])) || in(seq.stop_token_ids, tokens[j])) {
        m = j + 1;
        reason = FinishReason::kStop;
        break;
      }
    }
  }
  seq.token_ids.insert(seq.token_ids.end(), tokens, tokens + m);
  if (reason != FinishReason::kNone) finish(seq, reason);
  return m;
}

void Scheduler::finish(Sequence& seq, FinishReason reason) {
  if (seq.kv.allocated) block_manager_.free(seq.kv);
  if (seq.status == SeqStatus::kRunning)
    running_.erase(std::find(running_.begin(), running_.end(), &seq));
  else if (seq.status == SeqStatus::kWaiting)
    waiting_.erase(std::find(waiting_.begin(), waiting_.end(), &seq));
  seq.status = SeqStatus::kFinished;
  seq.finish_reason = reason;
  seq.draft_tokens.clear();
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
      for (int64_t j = 0; j + 1 < c; ++j)
        PE_CHECK(tokens[total + j] == r.seq->draft_tokens[j], "row ", i, ": accepted token ", j,
                 " differs from the draft it accepts");
    } else {
      bool last_chunk = r.seq->num_computed + r.num_scheduled == r.seq->num_tokens();
      PE_CHECK(c == (last_chunk ? 1 : 0), "row ", i, ": a prefill chunk commits ", last_chunk ? 1 : 0,
               " tokens, got ", c);
    }
    total += c;
  }
  PE_CHECK(total == num_tokens, "update() got ", num_tokens, " tokens, counts add up to ", total);

  UpdateResult res;
  res.num_committed.reserve(num_rows);
  res.finish_reason.reserve(num_rows);
  step_in_flight_ = false;
  int64_t off = 0;
  for (int64_t i = 0; i < num_rows; ++i) {
    const Row& r = in_flight_[i];
    Sequence& seq = *r.seq;
    const int32_t c = counts[i];
    if (r.is_decode && r.num_drafts > 0) {
      ++stats_.num_verify_rows;
      stats_.num_verify_committed += c;
      stats_.num_draft_tokens += r.num_drafts;
      stats_.num_accepted_tokens += c - 1;
      for (int32_t j = 0; j < r.num_drafts; ++j) {
        ++stats_.drafted_per_position[j];
        if (j < c - 1) ++stats_.accepted_per_position[j];
      }
    }
    // KV is valid for the inputs that were committed tokens: a prefill chunk entirely, a verify
    // row's last committed token plus its accepted drafts. Rejected slots are overwritten later.
    seq.num_computed += r.is_decode ? c : r.num_scheduled;
    seq.num_accepted_last = r.is_decode ? c : 1;
    seq.draft_tokens.clear();
    const int32_t committed = commit_tokens(seq, tokens + off, c);
    const bool stopped = seq.status == SeqStatus::kFinished;
    off += c;
    res.num_committed.push_back(committed);
    res.finish_reason.push_back(static_cast<int8_t>(seq.finish_reason));
    const int64_t num_valid = std::min(seq.num_computed, seq.num_tokens());
    if (!stopped && block_manager_.has_new_full_block(seq.kv, num_valid))
      block_manager_.cache_full_blocks(seq.kv, seq.token_ids.data(), num_valid);
  }
  for (const Row& r : in_flight_)
    if (r.seq->status == SeqStatus::kFinished) seqs_.erase(r.seq->seq_id);
  in_flight_.clear();
  return res;
}

std::vector<int64_t> Scheduler::running_ids() const {
  std::vector<int64_t> ids;
  for (const Sequence* s : running_) ids.push_back(s->seq_id);
  return ids;
}

void Scheduler::check_invariants() const {
  std::vector<const KVAllocation*> tables;
  for (const Sequence* s : running_) {
    PE_ASSERT(s->kv.allocated && s->status == SeqStatus::kRunning);
    PE_ASSERT(s->num_computed <= s->num_tokens());
    tables.push_back(&s->kv);
  }
  for (const Sequence* s : waiting_) PE_ASSERT(!s->kv.allocated && s->num_computed == 0);
  block_manager_.check_invariants(tables);
}

}  // namespace pyengine
