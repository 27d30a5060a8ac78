// A token history indexed for suffix decoding: the tokens themselves and, for every position q that
// has a context (an "occurrence": tokens[q] followed tokens[.., q)), links to the previous occurrence
// with the same last token and with the same last two tokens. A draft search walks a chain from its
// newest occurrence and measures each match by comparing tokens backward, so memory is ~12 bytes a
// token plus one head per distinct context - where a hash entry per (position, context length)
// cost ~1.5 KB a token at depth 24 - and nothing is rehashed but the heads.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace pyengine {

class SuffixHistory {
 public:
  struct Candidate {
    int32_t pos;    // an occurrence: tokens[pos] is the continuation
    int32_t match;  // how many tokens before pos equal the end of the searched context (<= depth)
  };
  static constexpr int32_t kSeparator = -1;  // between finished requests' segments in a shared cache
  static constexpr int kMaxCandidates = 256;  // newest occurrences examined per search

  // Append a token; occurrence: index it under the one and two tokens before it (when those exist
  // and are not separators).
  void append(int32_t token, bool occurrence);
  void clear();
  int64_t size() const { return static_cast<int64_t>(tokens_.size()); }
  int32_t token(int32_t pos) const { return tokens_[pos]; }
  bool is_occurrence(int64_t pos) const { return pos < size() && prev1_[pos] != kNotIndexed; }

  // The newest occurrences (at most kMaxCandidates) whose last two tokens equal ctx's, or, if none
  // has, whose last token does; match lengths counted up to depth. ctx holds len >= 1 tokens.
  void search(const int32_t* ctx, int64_t len, int32_t depth, std::vector<Candidate>& out) const;

 private:
  static constexpr int32_t kNotIndexed = -2, kNone = -1;
  // Open-addressing map context key -> newest occurrence (key 0: empty), at most half full.
  struct Head {
    uint64_t key = 0;
    int32_t pos = kNone;
  };
  int32_t& head(uint64_t key);
  int32_t newest(uint64_t key) const;
  void collect(uint64_t key, const std::vector<int32_t>& prev, const int32_t* ctx, int64_t len, int32_t depth,
               std::vector<Candidate>& out) const;

  std::vector<int32_t> tokens_;
  std::vector<int32_t> prev1_, prev2_;  // previous occurrence with the same last 1 / 2 tokens
  std::vector<Head> heads_;
  size_t used_ = 0;
};

}  // namespace pyengine
