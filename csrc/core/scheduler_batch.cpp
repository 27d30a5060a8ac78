// Scheduler, second half of schedule(): the scheduled rows become one batch of flat arrays.
#include <algorithm>
#include <numeric>

#include "scheduler.h"

namespace pyengine {

std::shared_ptr<ScheduledBatch> Scheduler::reusable_batch() {
  // A batch reaches Python as views of its arrays, which keep it alive. Once nothing references a
  // pooled batch any more, the next step refills it: no arrays to allocate (and no fresh pages to
  // fault in) on the step path.
  for (const std::shared_ptr<ScheduledBatch>& b : batch_pool_)
    if (b.use_count() == 1) return b;
  auto b = std::make_shared<ScheduledBatch>();
  if (batch_pool_.size() < kBatchPoolSize) batch_pool_.push_back(b);
  return b;
}

void Scheduler::build_batch(const std::vector<Row>& rows, ScheduledBatch& b) const {
  // Sized once, filled through pointers: this runs every step over every scheduled token.
  const int64_t B = config_.block_size;
  const int32_t slots_per_seq = block_manager_.state_slots_per_seq();
  const size_t n = rows.size();
  int64_t num_tokens = 0, num_logits = 0, max_end = 0, num_decode_tokens = 0;
  for (const Row& r : rows) {
    num_tokens += r.num_scheduled;
    num_logits += r.num_logits;
    num_decode_tokens += r.is_decode ? r.num_scheduled : 0;
    max_end = std::max(max_end, r.seq->num_computed + r.num_scheduled);
  }
  b.max_blocks = static_cast<int32_t>(ceil_div(max_end, B));
  b.max_query_len = b.max_context_len = 0;
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
  b.request_slots.resize(n);
  b.tokens_left.resize(n);
  b.logits_indices.resize(num_logits);
  b.state_slots.resize(n * slots_per_seq);
  b.block_tables.resize(n * b.max_blocks);
  int64_t* ids = b.input_ids.data();
  int64_t* pos = b.positions.data();
  int64_t* slots = b.slot_mapping.data();
  // Logits: every token of a decode/verify row (those rows come first, so their indices are
  // 0, 1, 2, ...), then the last token of each prefill chunk that completes its prompt.
  int32_t* logits_idx = b.logits_indices.data() + num_decode_tokens;
  std::iota(b.logits_indices.data(), logits_idx, 0);
  int32_t q = 0, drafts = 0;
  b.query_start_loc[0] = b.cu_num_draft_tokens[0] = 0;
  for (size_t i = 0; i < n; ++i) {
    const Row& r = rows[i];
    const Sequence& s = *r.seq;
    const int64_t start = s.num_computed, end = start + r.num_scheduled;
    // Inputs: committed tokens from num_computed on, then the drafts.
    const int64_t split = std::min(end, s.num_tokens());
    for (int64_t p = start; p < split; ++p) *ids++ = s.token_ids[p];
    const int32_t* row_drafts = draft_row(s.slot);
    for (int64_t p = split; p < end; ++p) *ids++ = row_drafts[p - split];
    // Positions and slots, one block at a time: inside block j, slot = p + (table[j] - j) * B.
    const int32_t* table = s.kv.block_table.data();
    int64_t blk = start / B;
    for (int64_t p = start; p < end; ++blk) {
      const int64_t block_end = std::min(end, (blk + 1) * B), shift = (table[blk] - blk) * B;
      for (; p < block_end; ++p) {
        *pos++ = p;
        *slots++ = p + shift;
      }
    }
    PE_ASSERT(r.num_scheduled > 0);  // so blk is now ceil(end / B), the blocks the context spans
    int32_t* row_table = b.block_tables.data() + i * b.max_blocks;
    std::fill(std::copy_n(table, blk, row_table), row_table + b.max_blocks, -1);
    q += r.num_scheduled;
    if (!r.is_decode && r.num_logits == 1) *logits_idx++ = q - 1;
    drafts += r.num_drafts;
    b.seq_ids[i] = s.seq_id;
    b.query_start_loc[i + 1] = q;
    b.cu_num_draft_tokens[i + 1] = drafts;
    b.context_lens[i] = static_cast<int32_t>(end);
    b.num_computed[i] = static_cast<int32_t>(start);
    b.num_draft_tokens[i] = r.num_drafts;
    b.num_logits[i] = r.num_logits;
    b.num_accepted_prev[i] = s.num_accepted_last;
    b.request_slots[i] = s.slot;
    b.tokens_left[i] = tokens_left(s);
    if (slots_per_seq > 0)
      std::copy_n(s.kv.state_slots.data(), slots_per_seq, b.state_slots.data() + i * slots_per_seq);
    b.max_query_len = std::max(b.max_query_len, r.num_scheduled);
    b.max_context_len = std::max(b.max_context_len, static_cast<int32_t>(end));
  }
}

}  // namespace pyengine
