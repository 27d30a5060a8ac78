#include "suffix_proposer.h"

#include <algorithm>
#include <utility>

namespace pyengine {

namespace {

// The most frequent continuation among the candidates matching best_len tokens (the newest
// occurrence's token among equally frequent ones), with its count and the number of such candidates.
struct Choice {
  int32_t token = -1, count = 0, total = 0;
};

Choice most_frequent(const SuffixHistory& history, const std::vector<SuffixHistory::Candidate>& found,
                     int32_t best_len) {
  std::vector<std::pair<int32_t, int32_t>> next;  // (token, rank: 0 = newest)
  for (const auto& c : found)
    if (c.match == best_len) next.push_back({history.token(c.pos), static_cast<int32_t>(next.size())});
  std::sort(next.begin(), next.end());
  Choice best;
  best.total = static_cast<int32_t>(next.size());
  int32_t best_rank = 0;
  for (size_t i = 0; i < next.size();) {
    size_t j = i;
    while (j < next.size() && next[j].first == next[i].first) ++j;
    const auto count = static_cast<int32_t>(j - i);
    if (count > best.count || (count == best.count && next[i].second < best_rank)) {
      best.token = next[i].first;
      best.count = count;
      best_rank = next[i].second;  // the run's first entry has its smallest rank
    }
    i = j;
  }
  return best;
}

}  // namespace

SuffixProposer::Request& SuffixProposer::index(int64_t seq_id, const int32_t* tokens, int64_t n, int64_t prompt_len) {
  Request& r = requests_[seq_id];
  if (r.history.size() == 0) r.prompt_len = prompt_len;
  for (int64_t p = r.history.size(); p < n; ++p) r.history.append(tokens[p], true);
  return r;
}

int32_t SuffixProposer::propose(int64_t seq_id, const int32_t* tokens, int64_t n, int64_t prompt_len, int32_t k,
                                int32_t* out) {
  return predict(seq_id, tokens, n, prompt_len, nullptr, 0, k, out);  // no drafts in flight
}

int32_t SuffixProposer::predict(int64_t seq_id, const int32_t* tokens, int64_t n, int64_t prompt_len,
                                const int32_t* ext, int32_t m, int32_t k, int32_t* out) {
  const Request& r = index(seq_id, tokens, n, prompt_len);
  if (k <= 0 || n + m == 0) return 0;
  const int64_t depth = config_.max_depth;
  std::vector<int32_t> ctx(tokens + n - std::min<int64_t>(n, std::max<int64_t>(0, depth - m)), tokens + n);
  ctx.insert(ctx.end(), ext + std::max<int64_t>(0, m - depth), ext + m);
  return chain(r, std::move(ctx), k, out);
}

int32_t SuffixProposer::chain(const Request& r, std::vector<int32_t> ctx, int32_t k, int32_t* out) {
  const int32_t depth = config_.max_depth;
  const SuffixHistory* sources[3] = {&r.history, &recent_, &older_};
  for (int s = 0; s < 3; ++s) sources[s]->search(ctx.data(), static_cast<int64_t>(ctx.size()), depth, found_[s]);
  int32_t num = 0, cap = k;
  while (num < cap) {
    int32_t best_len = 0, best_src = -1;  // the longest match; the earlier source on a tie
    for (int s = 0; s < 3; ++s)
      for (const auto& c : found_[s])
        if (c.match > best_len) best_len = c.match, best_src = s;
    if (best_src < 0) break;
    if (num == 0) cap = std::min<int32_t>(k, std::max<int32_t>(1, static_cast<int32_t>(config_.max_spec_factor * best_len)));
    const Choice choice = most_frequent(*sources[best_src], found_[best_src], best_len);
    if (static_cast<float>(choice.count) < config_.min_token_prob * static_cast<float>(choice.total)) break;
    out[num++] = choice.token;
    ctx.push_back(choice.token);
    // The extended context's matches are the successors of the occurrences that continued with the
    // drafted token, one token longer; where none has a successor, search again.
    bool any = false;
    for (int s = 0; s < 3; ++s) {
      next_.clear();
      for (const auto& c : found_[s])
        if (sources[s]->token(c.pos) == choice.token && sources[s]->is_occurrence(c.pos + int64_t{1}))
          next_.push_back({c.pos + 1, std::min(c.match + 1, depth)});
      std::swap(found_[s], next_);
      any = any || !found_[s].empty();
    }
    if (!any && num < cap)
      for (int s = 0; s < 3; ++s) sources[s]->search(ctx.data(), static_cast<int64_t>(ctx.size()), depth, found_[s]);
  }
  return num;
}

void SuffixProposer::forget(int64_t seq_id, bool finished) {
  auto it = requests_.find(seq_id);
  if (it == requests_.end() || !finished) return;
  const Request r = std::move(it->second);
  requests_.erase(it);
  const int64_t n = r.history.size();
  if (config_.max_cached_tokens <= 0 || n <= r.prompt_len) return;
  // A separator, the prompt's last max_depth tokens (contexts only), then the output.
  recent_.append(SuffixHistory::kSeparator, false);
  for (int64_t p = std::max<int64_t>(0, r.prompt_len - config_.max_depth); p < n; ++p)
    recent_.append(r.history.token(static_cast<int32_t>(p)), p >= r.prompt_len);
  recent_tokens_ += n - r.prompt_len;
  if (recent_tokens_ > config_.max_cached_tokens / 2) {  // the recent generation becomes the older one
    std::swap(older_, recent_);
    recent_.clear();
    older_tokens_ = recent_tokens_;
    recent_tokens_ = 0;
  }
}

}  // namespace pyengine
