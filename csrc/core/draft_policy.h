// The draft-length policy's host work (pyengine/spec_decode/draft_length.py, DraftLengthPolicy): the
// evidence from one verify step folded into its per-request counts in place (observe_rows), and the
// plan of a graph-replayed step with its probes (draft_lengths). One C++ pass each instead of ~30
// NumPy operations on the host's critical path around each step with drafts.
#pragma once

#include <cstdint>

namespace pyengine {

struct DraftPolicyCounts {  // views of the policy's arrays; 2-D ones [slots, k] row-major
  double* trials;           // decayed count: draft j verified after drafts 0..j-1 were accepted
  double* accepts;          // ... and accepted
  double* asked;            // [slots] steps the row was asked for drafts
  double* found;            // [slots] ... in which the proposer found at least one
  int64_t* idle;            // steps since position j was last verified
  int64_t* probes;          // [slots] this step's first probed position, -1: none
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

// Graph-replayed steps (DraftLengthPolicy._padded_lengths): every eligible row drafts the d in 0..k
// with the best expected tokens per second, cost[d] being a step whose longest row drafts d, or none
// unless that beats d = 0 by margin. closed: no request waits (a position counts only if every
// eligible row accepts it). lengths[i]: the row's drafts.
void padded_draft_lengths(const DraftPolicyCounts& c, const int64_t* slots, const bool* eligible, int64_t num_rows,
                          const double* cost, bool closed, double margin, double prior_weight, int64_t* lengths);

struct ProbeSchedule {
  double due;               // the step from which a new probe may be due (the plan repeats until then)
  int64_t last_probe_step;  // graph steps: the last step that probed
};

// The probes of a plan (DraftLengthPolicy.draft_lengths): an eligible row whose next position has been
// idle for `interval` steps probes it (lengths[i] grows by `probe`, probes[slot] = its first probed
// position); on graph steps at most one probe step per interval, in which rows idle for half of it probe.
ProbeSchedule schedule_probes(const DraftPolicyCounts& c, const int64_t* slots, const bool* eligible, int64_t num_rows,
                              int64_t* lengths, double interval, bool graph_steps, int64_t steps,
                              int64_t last_probe_step, int64_t probe_every, int64_t probe);

}  // namespace pyengine
