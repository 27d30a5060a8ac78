// The running requests whose next step decodes, as flat arrays: what a proposer and the
// draft-length policy need per step, handed to Python in one call (numpy views).
#pragma once

#include <cstdint>

#include "scheduled_batch.h"

namespace pyengine {

// Rows in admission order (the order schedule() visits decode rows).
struct DecodeView {
  BatchArray<int64_t> seq_ids;
  BatchArray<int32_t> request_slots;   // Sequence::slot: a dense index < max_num_seqs
  BatchArray<int64_t> num_tokens;      // committed tokens
  BatchArray<int64_t> tokens_left;     // tokens it may still commit (max_tokens, max_model_len)
  // Over every running request (decoding or prefilling): the largest of its fewest tokens left
  // (tokens_left if only length can stop it, else 1: EOS or a stop may come any time).
  int64_t max_fewest_tokens_left = 0;
  int64_t num_waiting = 0;

  int32_t num_rows() const { return static_cast<int32_t>(seq_ids.size()); }
};

}  // namespace pyengine
