#include "suffix_proposer.h"

#include <algorithm>

namespace pyengine {

namespace {

inline uint64_t mix64(uint64_t x) {  // splitmix64 finaliser
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return x;
}

// The key of the context of length d whose hash over its shorter suffix is h: extend by the token
// d back from the end. Contexts are hashed from their end, so lengths 1..D cost one step each.
inline uint64_t extend(uint64_t h, int32_t token, int64_t d) {
  return mix64(h ^ (static_cast<uint64_t>(static_cast<uint32_t>(token)) + 0x9e3779b97f4a7c15ULL * static_cast<uint64_t>(d)));
}

constexpr uint64_t kSeed = 0x2545f4914f6cdd1dULL;

}  // namespace

void SuffixIndex::add(const int32_t* tokens, int64_t p, int32_t max_depth, int32_t sign) {
  const int32_t next = tokens[p];
  uint64_t h = kSeed;
  for (int64_t d = 1; d <= std::min<int64_t>(max_depth, p); ++d) {
    h = extend(h, tokens[p - d], d);
    std::vector<Next>& counts = map_[h];
    auto it = std::find_if(counts.begin(), counts.end(), [&](const Next& e) { return e.token == next; });
    if (it == counts.end()) {
      if (sign > 0) counts.push_back({next, 1});
    } else if ((it->count += sign) <= 0) {
      *it = counts.back();
      counts.pop_back();
    }
    if (counts.empty()) map_.erase(h);
  }
}

int32_t SuffixProposer::propose(int64_t seq_id, const int32_t* tokens, int64_t n, int32_t k, int32_t* out) {
  Request& r = requests_[seq_id];
  for (int64_t p = static_cast<int64_t>(r.tokens.size()); p < n; ++p) {
    r.tokens.push_back(tokens[p]);
    r.index.add(r.tokens.data(), p, config_.max_depth);
  }
  const int64_t depth = config_.max_depth;
  std::vector<int32_t> ctx(r.tokens.end() - std::min<int64_t>(n, depth), r.tokens.end());
  int32_t num = 0, cap = k;
  while (num < cap) {
    // The longest context either index has seen: a context never seen has no longer extension
    // seen either, so the search stops at the first miss in both.
    const std::vector<SuffixIndex::Next>* best = nullptr;
    int64_t best_len = 0;
    uint64_t h = kSeed;
    const int64_t size = static_cast<int64_t>(ctx.size());
    for (int64_t d = 1; d <= std::min(depth, size); ++d) {
      h = extend(h, ctx[size - d], d);
      const std::vector<SuffixIndex::Next>* own = r.index.find(h);
      const std::vector<SuffixIndex::Next>* global = own ? nullptr : global_.find(h);
      if (!own && !global) break;
      best = own ? own : global;
      best_len = d;
    }
    if (best == nullptr) break;
    if (num == 0) cap = std::min<int32_t>(k, std::max<int32_t>(1, static_cast<int32_t>(config_.max_spec_factor * best_len)));
    int64_t total = 0;
    SuffixIndex::Next pick{0, 0};
    for (const SuffixIndex::Next& e : *best) {
      total += e.count;
      if (e.count > pick.count || (e.count == pick.count && e.token < pick.token)) pick = e;
    }
    if (static_cast<float>(pick.count) < config_.min_token_prob * static_cast<float>(total)) break;
    out[num++] = pick.token;
    ctx.push_back(pick.token);
  }
  return num;
}

void SuffixProposer::forget(int64_t seq_id, bool finished) {
  auto it = requests_.find(seq_id);
  if (it == requests_.end() || !finished) return;
  std::vector<int32_t> tokens = std::move(it->second.tokens);
  requests_.erase(it);
  if (config_.max_cached_tokens <= 0 || tokens.empty()) return;
  for (int64_t p = 1; p < static_cast<int64_t>(tokens.size()); ++p) global_.add(tokens.data(), p, config_.max_depth);
  cached_tokens_ += static_cast<int64_t>(tokens.size());
  cached_.push_back(std::move(tokens));
  while (cached_tokens_ > config_.max_cached_tokens && !cached_.empty()) {
    const std::vector<int32_t>& old = cached_.front();
    for (int64_t p = 1; p < static_cast<int64_t>(old.size()); ++p) global_.add(old.data(), p, config_.max_depth, -1);
    cached_tokens_ -= static_cast<int64_t>(old.size());
    cached_.pop_front();
  }
}

}  // namespace pyengine
