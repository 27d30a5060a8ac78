// One request inside the scheduler. Three counters, never mixed:
//   token_ids.size()  committed tokens (prompt + accepted outputs)
//   num_computed      positions whose KV (or recurrent state) is valid
//   drafts            this step's proposals, kept apart from the committed tokens (num_drafts of
//                     them, in the scheduler's draft matrix at row `slot`)
// After every decode/verify step: num_computed == num_tokens() - 1.
#pragma once

#include <cstdint>
#include <vector>

#include "block_manager.h"

namespace pyengine {

enum class SeqStatus : int8_t { kWaiting = 0, kRunning = 1, kFinished = 2 };
enum class FinishReason : int8_t { kNone = 0, kStop = 1, kLength = 2, kAbort = 3 };

// Laid out by use: a step reads the first two cache lines of each running request and the rest
// only when it hashes a block (the prefix-cache fields of kv) or admits the request.
struct alignas(64) Sequence {
  int64_t seq_id = 0;
  int64_t num_computed = 0;
  std::vector<int32_t> token_ids;
  int32_t slot = -1;       // while running: a dense index < max_num_seqs (row of the draft matrix)
  int32_t num_drafts = 0;  // this step's proposals, row `slot` of the scheduler's draft matrix
  int64_t num_prompt_tokens = 0;
  int64_t max_tokens = 16;

  int32_t num_accepted_last = 1;  // tokens committed by the last step (recurrent-state offset a)
  SeqStatus status = SeqStatus::kWaiting;
  FinishReason finish_reason = FinishReason::kNone;
  std::vector<int32_t> stop_token_ids;  // a commit stops at any of these: stop ids and, unless
                                        // ignore_eos, the EOS ids
  bool only_length_stops = false;       // no stop id and no stop string: it runs to its length
  KVAllocation kv;

  int64_t cache_salt = 0;  // extra prefix-cache key (e.g. per tenant)

  int64_t num_tokens() const { return static_cast<int64_t>(token_ids.size()); }
  int64_t num_output_tokens() const { return num_tokens() - num_prompt_tokens; }
  // A decode (or verify) row feeds exactly the last committed token; anything more is prefill.
  bool is_decode() const { return num_computed == num_tokens() - 1; }
};

}  // namespace pyengine
