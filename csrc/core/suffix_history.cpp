#include "suffix_history.h"

#include <algorithm>
#include <cassert>

#include "mix64.h"

namespace pyengine {

namespace {

// Context keys (tokens are >= 0 and < 2^31): one token t -> t + 1; two tokens (a, b) -> the top bit
// set over a and b. Never 0 (the empty slot) and never equal across the two kinds.
inline uint64_t key1(int32_t b) { return static_cast<uint64_t>(b) + 1; }
inline uint64_t key2(int32_t a, int32_t b) {
  return (uint64_t{1} << 63) | (static_cast<uint64_t>(a) << 31) | static_cast<uint64_t>(b);
}

}  // namespace

int32_t& SuffixHistory::head(uint64_t key) {
  if (2 * (used_ + 1) > heads_.size()) {  // grow: at most half full
    std::vector<Head> old = std::move(heads_);
    heads_.assign(std::max<size_t>(256, 2 * old.size()), Head{});
    const size_t mask = heads_.size() - 1;
    for (const Head& h : old) {
      if (h.key == 0) continue;
      size_t i = mix64(h.key) & mask;
      while (heads_[i].key != 0) i = (i + 1) & mask;
      heads_[i] = h;
    }
  }
  const size_t mask = heads_.size() - 1;
  size_t i = mix64(key) & mask;
  while (heads_[i].key != 0 && heads_[i].key != key) i = (i + 1) & mask;
  if (heads_[i].key == 0) {
    heads_[i].key = key;
    ++used_;
  }
  return heads_[i].pos;
}

int32_t SuffixHistory::newest(uint64_t key) const {
  if (heads_.empty()) return kNone;
  const size_t mask = heads_.size() - 1;
  for (size_t i = mix64(key) & mask;; i = (i + 1) & mask) {
    if (heads_[i].key == key) return heads_[i].pos;
    if (heads_[i].key == 0) return kNone;
  }
}

void SuffixHistory::append(int32_t token, bool occurrence) {
  const auto q = static_cast<int32_t>(tokens_.size());
  tokens_.push_back(token);
  prev1_.push_back(kNotIndexed);
  prev2_.push_back(kNotIndexed);
  if (!occurrence || q < 1 || tokens_[q - 1] == kSeparator) return;
  int32_t& newest1 = head(key1(tokens_[q - 1]));
  prev1_[q] = newest1;
  newest1 = q;
  if (q < 2 || tokens_[q - 2] == kSeparator) return;
  int32_t& newest2 = head(key2(tokens_[q - 2], tokens_[q - 1]));
  prev2_[q] = newest2;
  newest2 = q;
}

void SuffixHistory::clear() {
  tokens_.clear();
  prev1_.clear();
  prev2_.clear();
  heads_.clear();
  used_ = 0;
}

void SuffixHistory::collect(uint64_t key, const std::vector<int32_t>& prev, const int32_t* ctx, int64_t len,
                            int32_t depth, std::vector<Candidate>& out) const {
  for (int32_t q = newest(key); q >= 0 && static_cast<int>(out.size()) < kMaxCandidates; q = prev[q]) {
    int32_t m = 0;
    while (m < depth && m < len && q - 1 - m >= 0 && tokens_[q - 1 - m] == ctx[len - 1 - m]) ++m;
    assert(m >= 1);
    out.push_back({q, m});
  }
}

void SuffixHistory::search(const int32_t* ctx, int64_t len, int32_t depth, std::vector<Candidate>& out) const {
  out.clear();
  if (len >= 2 && depth >= 2) collect(key2(ctx[len - 2], ctx[len - 1]), prev2_, ctx, len, depth, out);
  if (out.empty()) collect(key1(ctx[len - 1]), prev1_, ctx, len, std::min(depth, 1), out);
}

}  // namespace pyengine
