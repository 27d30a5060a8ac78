#include "suffix_proposer.h"

#include <algorithm>
#include <utility>

#include "mix64.h"

namespace pyengine {

namespace {

// The key of a context of length d from the key of its suffix of length d - 1 and the token d back
// from the end: contexts are hashed from their end, so lengths 1..D cost one step each. Never 0.
inline uint64_t extend(uint64_t h, int32_t token, int64_t d) {
  return mix64(h ^ (static_cast<uint64_t>(static_cast<uint32_t>(token)) + 0x9e3779b97f4a7c15ULL * static_cast<uint64_t>(d))) | 1;
}

constexpr uint64_t kSeed = 0x2545f4914f6cdd1dULL;

}  // namespace

SuffixIndex::Entry& SuffixIndex::slot(uint64_t key) {
  if (2 * (used_ + 1) > table_.size()) {  // grow: at most half full
    std::vector<Entry> old = std::move(table_);
    table_.assign(std::max<size_t>(1024, 2 * old.size()), Entry{});
    const size_t mask = table_.size() - 1;
    for (const Entry& e : old) {
      if (e.key == 0) continue;
      size_t i = e.key & mask;
      while (table_[i].key != 0) i = (i + 1) & mask;
      table_[i] = e;
    }
  }
  const size_t mask = table_.size() - 1;
  size_t i = key & mask;
  while (table_[i].key != 0 && table_[i].key != key) i = (i + 1) & mask;
  if (table_[i].key == 0) {
    table_[i].key = key;
    ++used_;
  }
  return table_[i];
}

const SuffixIndex::Entry* SuffixIndex::find(uint64_t key) const {
  if (table_.empty()) return nullptr;
  const size_t mask = table_.size() - 1;
  for (size_t i = key & mask;; i = (i + 1) & mask) {
    if (table_[i].key == key) return &table_[i];
    if (table_[i].key == 0) return nullptr;
  }
}

void SuffixIndex::add(const int32_t* tokens, int64_t p, int32_t max_depth) {
  const int32_t next = tokens[p];
  uint64_t h = kSeed;
  for (int64_t d = 1; d <= std::min<int64_t>(max_depth, p); ++d) {
    h = extend(h, tokens[p - d], d);
    Entry& e = slot(h);
    ++e.total;
    if (e.token[0] == next) {
      ++e.count[0];
    } else if (e.token[1] == next) {
      ++e.count[1];
    } else if (e.count[0] == 0) {
      e.token[0] = next;
      e.count[0] = 1;
    } else if (e.count[1] <= 1) {  // the second candidate gives way to a new one
      e.token[1] = next;
      e.count[1] = 1;
    }
    if (e.count[1] > e.count[0]) {
      std::swap(e.token[0], e.token[1]);
      std::swap(e.count[0], e.count[1]);
    }
  }
}

int32_t SuffixProposer::propose(int64_t seq_id, const int32_t* tokens, int64_t n, int64_t prompt_len, int32_t k,
                                int32_t* out) {
  Request& r = requests_[seq_id];
  if (r.tokens.empty()) r.prompt_len = prompt_len;
  for (int64_t p = static_cast<int64_t>(r.tokens.size()); p < n; ++p) {
    r.tokens.push_back(tokens[p]);
    r.index.add(r.tokens.data(), p, config_.max_depth);
  }
  const int64_t depth = config_.max_depth;
  std::vector<int32_t> ctx(r.tokens.end() - std::min<int64_t>(n, depth), r.tokens.end());
  const SuffixIndex* indexes[3] = {&r.index, &recent_, &older_};
  int32_t num = 0, cap = k;
  while (num < cap) {
    // The longest context any index has seen (the request's own first on equal length): a
    // context never seen has no longer extension seen either, so the search stops at a miss.
    const SuffixIndex::Entry* best = nullptr;
    int64_t best_len = 0;
    uint64_t h = kSeed;
    const int64_t size = static_cast<int64_t>(ctx.size());
    for (int64_t d = 1; d <= std::min(depth, size); ++d) {
      h = extend(h, ctx[size - d], d);
      const SuffixIndex::Entry* found = nullptr;
      for (const SuffixIndex* index : indexes)
        if ((found = index->find(h)) != nullptr) break;
      if (found == nullptr) break;
      best = found;
      best_len = d;
    }
    if (best == nullptr) break;
    if (num == 0) cap = std::min<int32_t>(k, std::max<int32_t>(1, static_cast<int32_t>(config_.max_spec_factor * best_len)));
    if (static_cast<float>(best->count[0]) < config_.min_token_prob * static_cast<float>(best->total)) break;
    out[num++] = best->token[0];
    ctx.push_back(best->token[0]);
  }
  return num;
}

void SuffixProposer::forget(int64_t seq_id, bool finished) {
  auto it = requests_.find(seq_id);
  if (it == requests_.end() || !finished) return;
  const Request r = std::move(it->second);
  requests_.erase(it);
  const int64_t n = static_cast<int64_t>(r.tokens.size());
  if (config_.max_cached_tokens <= 0 || n <= r.prompt_len) return;
  // Its output, each token under contexts that reach back into the prompt.
  for (int64_t p = std::max<int64_t>(1, r.prompt_len); p < n; ++p) recent_.add(r.tokens.data(), p, config_.max_depth);
  recent_tokens_ += n - r.prompt_len;
  if (recent_tokens_ > config_.max_cached_tokens / 2) {  // the recent generation becomes the older one
    std::swap(older_, recent_);
    recent_.clear();
    older_tokens_ = recent_tokens_;
    recent_tokens_ = 0;
  }
}

}  // namespace pyengine
