#include "greedy_accept.h"

#include <algorithm>

namespace pyengine {

GreedyAccepted greedy_accept(const int64_t* argmax, const bool* finite, int64_t num_argmax, const int32_t* num_logits,
                             const int32_t* num_drafts, const int32_t* query_start_loc, int64_t num_rows,
                             const int32_t* input_ids, int64_t num_inputs) {
  GreedyAccepted out;
  out.counts.resize(num_rows);
  out.first_bad.assign(num_rows, -1);
  int64_t start = 0;  // the row's first argmax
  for (int64_t r = 0; r < num_rows; ++r) {
    int32_t count = 0;
    if (num_logits[r] > 0) {
      int32_t kept = 0;
      while (kept < num_drafts[r] && num_inputs > 0) {
        const int64_t draft = input_ids[std::min<int64_t>(query_start_loc[r] + 1 + kept, num_inputs - 1)];
        if (draft != argmax[std::min<int64_t>(start + kept, num_argmax - 1)]) break;
        ++kept;
      }
      count = kept + 1;
    }
    for (int32_t o = 0; o < count; ++o) {
      out.tokens.push_back(static_cast<int32_t>(argmax[start + o]));
      if (!finite[start + o] && out.first_bad[r] < 0) {
        out.first_bad[r] = o;
        out.any_bad = true;
      }
    }
    out.counts[r] = count;
    start += num_logits[r];
  }
  return out;
}

}  // namespace pyengine
