#include "draft_policy.h"

#include <vector>

#include "common/common.h"

namespace pyengine {

DraftPolicyObserved observe_draft_rows(const DraftPolicyCounts& c, const int64_t* slots, const int32_t* num_drafts,
                                       const int32_t* num_committed, int64_t num_rows, double decay, bool graph_steps) {
  DraftPolicyObserved out;
  const int32_t k = c.k;
  std::vector<int64_t> rows, drafts, accepted;  // the rows asked for drafts
  for (int64_t i = 0; i < num_rows; ++i) {
    const int64_t s = slots[i];
    PE_CHECK(s >= 0 && s < c.num_slots, "observe_draft_rows: slot ", s, " outside the policy's ", c.num_slots);
    if (c.planned[s] <= 0) continue;
    rows.push_back(s);
    drafts.push_back(num_drafts[i]);
    accepted.push_back(num_committed[i] - 1);
  }
  if (rows.empty()) return out;
  out.asked_any = true;
  for (size_t r = 0; r < rows.size(); ++r) {
    const int64_t s = rows[r];
    c.asked[s] = decay * c.asked[s] + 1.0;
    out.drafts_any = out.drafts_any || drafts[r] > 0;
    if (c.probes[s] >= 0 && drafts[r] == 0) {
      out.unfilled_probes_any = true;
      if (graph_steps) c.idle[s * k + c.probes[s]] = 0;
    }
  }
  if (!out.drafts_any) {
    for (const int64_t s : rows) c.found[s] *= decay;
    return out;
  }
  std::vector<int64_t> tried_sum(k, 0), passed_sum(k, 0);
  for (size_t r = 0; r < rows.size(); ++r) {
    const int64_t s = rows[r], d = drafts[r], a = accepted[r];
    c.found[s] = decay * c.found[s] + (d > 0 ? 1.0 : 0.0);
    double* trials = c.trials + s * k;
    double* accepts = c.accepts + s * k;
    const int64_t start = c.probes[s];
    if (start >= 0 && a > start) {  // an accepted probe: the row's evidence from there on is stale
      for (int64_t j = start; j < k; ++j) trials[j] = accepts[j] = 0.0;
    }
    for (int64_t j = 0; j < k; ++j) {
      const bool verified = j < d, tried = verified && j <= a, passed = j < a;
      tried_sum[j] += tried;
      passed_sum[j] += passed;
      if (d > 0) {
        trials[j] = decay * trials[j] + (tried ? 1.0 : 0.0);
        accepts[j] = decay * accepts[j] + (passed ? 1.0 : 0.0);
        if (verified) c.idle[s * k + j] = 0;
      }
    }
  }
  for (int32_t j = 0; j < k; ++j) {
    c.pool_trials[j] = decay * c.pool_trials[j] + static_cast<double>(tried_sum[j]);
    c.pool_accepts[j] = decay * c.pool_accepts[j] + static_cast<double>(passed_sum[j]);
  }
  return out;
}

}  // namespace pyengine
