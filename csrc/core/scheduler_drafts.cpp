// What proposers hand the scheduler: each running decode request's drafts for the next step (in
// its row of the draft matrix), set on the host (set_draft_tokens*, propose_ngram) or, for drafts
// still on the device when the step is scheduled, placeholders filled in after schedule()
// (fill_drafts).
#include <algorithm>

#include "ngram_proposer.h"
#include "scheduler.h"

namespace pyengine {

int64_t Scheduler::max_useful_drafts(const Sequence& seq) const {
  // A verify step commits up to drafts + 1 tokens; drafts past the stop limits are wasted work.
  return std::max<int64_t>(0, std::min<int64_t>(config_.num_spec_tokens, tokens_left(seq) - 1));
}

Sequence& Scheduler::find_running(int64_t seq_id, int64_t i) {
  // Proposers list the running requests in order: take running_[i] when it matches and skip the
  // hash lookup.
  const bool in_order = i < num_running() && running_[i]->seq_id == seq_id;
  return in_order ? *running_[i] : find(seq_id);
}

void Scheduler::set_draft_tokens(int64_t seq_id, const int32_t* tokens, int64_t n) {
  set_draft_tokens(find(seq_id), tokens, n);
}

void Scheduler::set_draft_tokens(Sequence& seq, const int32_t* tokens, int64_t n) {
  PE_CHECK(n >= 0 && n <= config_.num_spec_tokens, "request ", seq.seq_id, ": ", n,
           " drafts exceed num_spec_tokens (", config_.num_spec_tokens, ")");
  PE_CHECK(seq.status == SeqStatus::kRunning && seq.is_decode(), "request ", seq.seq_id,
           " is not in a decode step and cannot take drafts");
  seq.num_drafts = static_cast<int32_t>(std::min(n, max_useful_drafts(seq)));
  std::copy_n(tokens, seq.num_drafts, draft_row(seq.slot));
}

void Scheduler::set_draft_tokens_batch(const int64_t* seq_ids, const int32_t* counts, int64_t num_seqs,
                                       const int32_t* tokens, int64_t num_tokens) {
  int64_t off = 0;
  for (int64_t i = 0; i < num_seqs; ++i) {
    PE_CHECK(off + counts[i] <= num_tokens, "counts exceed the draft tokens given");
    set_draft_tokens(find_running(seq_ids[i], i), tokens + off, counts[i]);
    off += counts[i];
  }
}

void Scheduler::fill_drafts(ScheduledBatch& batch, const int32_t* tokens, int64_t n) {
  PE_CHECK(step_in_flight_, "fill_drafts() without a scheduled step");
  const int64_t rows = batch.num_rows();
  PE_CHECK(rows == static_cast<int64_t>(in_flight_.size()), "fill_drafts(): the batch has ", rows,
           " rows, the step in flight ", in_flight_.size());
  PE_CHECK(n == batch.cu_num_draft_tokens[rows], "fill_drafts(): ", n, " tokens for ",
           batch.cu_num_draft_tokens[rows], " drafts");
  for (int64_t r = 0; r < rows; ++r) {
    const Row& row = in_flight_[r];
    PE_CHECK(row.seq->seq_id == batch.seq_ids[r] && row.num_drafts == batch.num_draft_tokens[r],
             "fill_drafts(): row ", r, " is not the in-flight step's");
    const int32_t* src = tokens + batch.cu_num_draft_tokens[r];
    std::copy_n(src, row.num_drafts, draft_row(row.slot));
    std::copy_n(src, row.num_drafts, batch.input_ids.data() + batch.query_start_loc[r] + 1);
  }
}

void Scheduler::propose_ngram(int32_t min_n, int32_t max_n, const int64_t* seq_ids, const int32_t* max_drafts,
                              int64_t num_seqs) {
  PE_CHECK(min_n >= 1 && max_n >= min_n, "ngram sizes need 1 <= min_n <= max_n, got ", min_n, "..", max_n);
  for (int64_t i = 0; i < num_seqs; ++i) {
    Sequence& seq = find_running(seq_ids[i], i);
    PE_CHECK(seq.status == SeqStatus::kRunning && seq.is_decode(), "request ", seq.seq_id,
             " is not a running decode request");
    const int64_t limit = std::min<int64_t>(max_drafts[i], max_useful_drafts(seq));
    seq.num_drafts = static_cast<int32_t>(propose_ngram_tokens(
        seq.token_ids.data(), seq.num_tokens(), min_n, max_n, static_cast<int32_t>(limit), draft_row(seq.slot)));
  }
}

}  // namespace pyengine
