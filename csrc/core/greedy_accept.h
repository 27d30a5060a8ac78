// Greedy verification on the host: which drafts a row keeps when every row's token is an argmax
// (pyengine/engine/greedy_sampler.py). Row r's num_logits[r] argmax values start at the sum of the
// rows before; its drafts are its inputs 1..num_drafts[r]. A row keeps its drafts while each equals
// the argmax at its position and commits the argmax after the last one kept.
#pragma once

#include <cstdint>
#include <vector>

namespace pyengine {

struct GreedyAccepted {
  std::vector<int32_t> tokens;      // the committed tokens, row after row
  std::vector<int32_t> counts;      // per row (0: a row without logits)
  std::vector<int64_t> first_bad;   // per row the first committed token whose logits were not finite, -1: none
  bool any_bad = false;
};

GreedyAccepted greedy_accept(const int64_t* argmax, const bool* finite, int64_t num_argmax, const int32_t* num_logits,
                             const int32_t* num_drafts, const int32_t* query_start_loc, int64_t num_rows,
                             const int32_t* input_ids, int64_t num_inputs);

}  // namespace pyengine
