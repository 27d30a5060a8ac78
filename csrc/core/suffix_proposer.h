// Suffix decoding: drafts from the continuations that followed the longest recurring suffix of a
// request's tokens, in that request (prompt and output so far) and in a bounded cache of recently
// finished requests' tokens (agentic and code-edit traffic repeats earlier answers).
//
// Each index maps a context - the last d tokens, d = 1..max_depth - to counts of the token that
// followed it. A draft chain starts at the longest context of the request that either index has
// seen, takes the most frequent next token (the request's own index first on a tie of match
// length), appends it and looks again with the extended context; it stops at k drafts, at
// max_spec_factor x the match length, or when the chosen token followed its context in less than
// min_token_prob of the cases. Drafts are only proposals: the target verifies every one.
#pragma once

#include <cstdint>
#include <deque>
#include <unordered_map>
#include <vector>

namespace pyengine {

struct SuffixConfig {
  int32_t max_depth = 24;           // longest context indexed
  float max_spec_factor = 1.0f;     // drafts per matched context token
  float min_token_prob = 0.1f;      // stop below this share of the context's continuations
  int64_t max_cached_tokens = 1 << 20;  // finished requests' tokens kept in the global index
};

// Context hash -> counts of the tokens that followed it. A context is keyed by the hash of its
// tokens and its length (collisions only cost a bad draft).
class SuffixIndex {
 public:
  struct Next {
    int32_t token;
    int32_t count;
  };
  // Index token[p] under its contexts tokens[p - d, p) for d = 1..max_depth (sign -1 removes).
  void add(const int32_t* tokens, int64_t p, int32_t max_depth, int32_t sign = 1);
  // The continuations of a context (nullptr: never seen).
  const std::vector<Next>* find(uint64_t key) const {
    auto it = map_.find(key);
    return it == map_.end() || it->second.empty() ? nullptr : &it->second;
  }
  bool empty() const { return map_.empty(); }

 private:
  std::unordered_map<uint64_t, std::vector<Next>> map_;
};

class SuffixProposer {
 public:
  explicit SuffixProposer(const SuffixConfig& config) : config_(config) {}

  // Index tokens[indexed, n) of request seq_id (its committed tokens grow between calls), then
  // write up to k drafts for its next position to out; returns how many.
  int32_t propose(int64_t seq_id, const int32_t* tokens, int64_t n, int32_t k, int32_t* out);
  // The request left: finished ones move their tokens into the global cache (oldest evicted past
  // max_cached_tokens); preempted ones keep their index (their committed tokens stay).
  void forget(int64_t seq_id, bool finished);
  int64_t num_cached_tokens() const { return cached_tokens_; }

 private:
  struct Request {
    SuffixIndex index;
    std::vector<int32_t> tokens;  // indexed so far
  };

  SuffixConfig config_;
  std::unordered_map<int64_t, Request> requests_;
  SuffixIndex global_;
  std::deque<std::vector<int32_t>> cached_;  // finished requests' tokens, oldest first
  int64_t cached_tokens_ = 0;
};

}  // namespace pyengine
