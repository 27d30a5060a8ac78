// One request inside the scheduler. Three counters, never mixed:
//   token_ids.size()  committed tokens (prompt + accepted outputs)
//   num_computed      positions whose KV (or recurrent state) is valid
//   draft_tokens      this step's proposals, kept apart from the committed tokens
// After every decode/verify step: num_computed == num_tokens() - 1.
#pragma once

#include <cstdint>
#include <vector>

#include "block_manager.h"

namespace pyengine {

enum class SeqStatus : int8_t { kWaiting = 0, kRunning = 1, kFinished = 2 };
enum class FinishReason : int8_t { kNone = 0, kStop = 1, kLength = 2, kAbort = 3 };

struct Sequence {
  int64_t seq_id = 0;
  std::vector<int32_t> token_ids;
  int64_t num_prompt_tokens = 0;
  int64_t num_computed = 0;
  std::vector<int32_t> draft_tokens;
  int32_t num_accepted_last = 1;  // tokens committed by the last step (recurrent-state offset a)

  // Stop conditions.
  int64_t max_tokens = 16;
  std::vector<int32_t> eos_token_ids;
  std::vector<int32_t> stop_token_ids;
  bool ignore_eos = false;
  int64_t cache_salt = 0;  // extra prefix-cache key (e.g. per tenant)

  SeqStatus status = SeqStatus::kWaiting;
  FinishReason finish_reason = FinishReason::kNone;
  KVAllocation kv;

  int64_t num_tokens() const { return static_cast<int64_t>(token_ids.size()); }
  int64_t num_output_tokens() const { return num_tokens() - num_prompt_tokens; }
  // A decode (or verify) row feeds exactly the last committed token; anything more is prefill.
  bool is_decode() const { return num_computed == num_tokens() - 1; }
};

}  // namespace pyengine
