// The draft-length policy's evidence from one verify step (pyengine/spec_decode/draft_length.py,
// DraftLengthPolicy.observe_rows), folded into its per-request counts in place: one C++ pass instead
// of ~30 NumPy operations on the host's critical path after each step with drafts.
#pragma once

#include <cstdint>

namespace pyengine {

struct DraftPolicyCounts {  // views of the policy's arrays; 2-D ones [slots, k] row-major
  double* trials;           // decayed count: draft j verified after drafts 0..j-1 were accepted
  double* accepts;          // ... and accepted
  double* asked;            // [slots] steps the row was asked for drafts
  double* found;            // [slots] ... in which the proposer found at least one
  int64_t* idle;            // steps since position j was last verified
  const int64_t* probes;    // [slots] this step's first probed position, -1: none
  const int64_t* planned;   // [slots] this step's planned lengths
  double* pool_trials;      // [k] batch-wide counts
  double* pool_accepts;
  int64_t num_slots;
  int32_t k;
};

struct DraftPolicyObserved {
  bool asked_any = false;            // some row was asked for drafts
  bool drafts_any = false;           // ... and some row had drafts (its counts were updated)
  bool unfilled_probes_any = false;  // some probed row found no drafts
};

// slots[i], num_drafts[i], num_committed[i]: the step's decode rows. graph_steps: an unfilled
// probe's position counts as verified (it waits an interval).
DraftPolicyObserved observe_draft_rows(const DraftPolicyCounts& c, const int64_t* slots, const int32_t* num_drafts,
                                       const int32_t* num_committed, int64_t num_rows, double decay, bool graph_steps);

}  // namespace pyengine
