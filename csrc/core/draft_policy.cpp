#include "draft_policy.h"

#include <algorithm>
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


void padded_draft_lengths(const DraftPolicyCounts& c, const int64_t* slots, const bool* eligible, int64_t num_rows,
                          const double* cost, bool closed, double margin, double prior_weight, int64_t* lengths) {
  const int32_t k = c.k;
  std::vector<double> prior(k), gain(k, 0.0), closed_gain(k, 1.0);
  for (int32_t j = 0; j < k; ++j) prior[j] = (c.pool_accepts[j] + 1e-12) / (c.pool_trials[j] + 1e-12);
  double none_found = 1.0;  // the chance that no eligible row's proposer finds drafts
  for (int64_t i = 0; i < num_rows; ++i) {
    const int64_t s = slots[i];
    PE_CHECK(s >= 0 && s < c.num_slots, "padded_draft_lengths: slot ", s, " outside the policy's ", c.num_slots);
    const double h = c.found[s] / c.asked[s];
    if (eligible[i]) none_found *= 1.0 - h;
    double p = 1.0;  // P_ij: drafts 0..j all accepted (0 for a row that may not draft)
    for (int32_t j = 0; j < k; ++j) {
      p *= (c.accepts[s * k + j] + prior_weight * prior[j]) / (c.trials[s * k + j] + prior_weight);
      const double pe = eligible[i] ? p : 0.0;
      gain[j] += h * pe;
      if (eligible[i]) closed_gain[j] *= h * pe;
    }
  }
  const double found_any = 1.0 - none_found;
  double gained = 0.0, best_rate = 0.0, rate0 = 0.0;  // gained: expected tokens the first d drafts add
  int32_t best = 0;
  for (int32_t d = 0; d <= k; ++d) {
    if (d > 0) gained += closed ? static_cast<double>(num_rows) * closed_gain[d - 1] : gain[d - 1];
    const double tokens = static_cast<double>(num_rows) + gained;
    const double rate = tokens / (cost[d] * found_any + cost[0] * (1.0 - found_any));
    if (d == 0) rate0 = rate;
    if (d == 0 || rate > best_rate) best = d, best_rate = rate;
  }
  const bool pays = best > 0 && best_rate > (1.0 + margin) * rate0;
  for (int64_t i = 0; i < num_rows; ++i) lengths[i] = pays && eligible[i] ? best : 0;
}

ProbeSchedule schedule_probes(const DraftPolicyCounts& c, const int64_t* slots, const bool* eligible, int64_t num_rows,
                              int64_t* lengths, double interval, bool graph_steps, int64_t steps,
                              int64_t last_probe_step, int64_t probe_every, int64_t probe) {
  const int32_t k = c.k;
  bool drafts_any = false, stale_any = false;
  std::vector<int64_t> idle(num_rows, -1);  // the idle count of a row's next position; -1: it cannot grow
  for (int64_t i = 0; i < num_rows; ++i) {
    const int64_t s = slots[i];
    PE_CHECK(s >= 0 && s < c.num_slots, "schedule_probes: slot ", s, " outside the policy's ", c.num_slots);
    drafts_any = drafts_any || lengths[i] > 0;
    if (eligible[i] && lengths[i] < k) {
      idle[i] = c.idle[s * k + lengths[i]];
      stale_any = stale_any || static_cast<double>(idle[i]) >= interval;
    }
  }
  bool probing = true;
  if (graph_steps) {
    // a probe makes the whole step a padded verify step: rows idle for half the interval probe along
    // when the step drafts anyway or a probe is due, and that at most once per interval
    probing = drafts_any || (stale_any && static_cast<double>(steps - last_probe_step) >= interval);
    if (probing) interval /= 2;
  }
  int64_t idle_max = 0;  // over the rows that can grow and do not probe now
  bool probed = false;
  for (int64_t i = 0; i < num_rows; ++i) {
    if (idle[i] < 0) continue;
    if (probing && static_cast<double>(idle[i]) >= interval) {
      c.probes[slots[i]] = lengths[i];
      lengths[i] = std::min<int64_t>(lengths[i] + probe, k);
      probed = true;
    } else {
      idle_max = std::max(idle_max, idle[i]);
    }
  }
  if (graph_steps && probed) last_probe_step = steps;
  double due = static_cast<double>(steps) + interval - static_cast<double>(idle_max);
  if (graph_steps) due = std::max(due, static_cast<double>(last_probe_step + probe_every));
  return {due, last_probe_step};
}

}  // namespace pyengine
