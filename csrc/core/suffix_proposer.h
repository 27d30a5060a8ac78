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

#include <cstddef>
#include <cstdint>
#include <unordered_map>
#include <vector>

namespace pyengine {

struct SuffixConfig {
  int32_t max_depth = 24;           // longest context indexed
  float max_spec_factor = 1.0f;     // drafts per matched context token
  float min_token_prob = 0.1f;      // stop below this share of the context's continuations
  int64_t max_cached_tokens = 1 << 20;  // finished requests' tokens kept in the global index
};

// Context (the hash of its tokens and length) -> its two most frequent next tokens with counts and
// the number of times it was seen. One flat open-addressing table (no allocation per context:
// every committed token adds max_depth contexts); keeping two candidates makes the counts
// approximate where a context had many different continuations, which only costs draft quality.
class SuffixIndex {
 public:
  struct Entry {
    uint64_t key = 0;  // 0: empty slot
    int32_t token[2] = {-1, -1};
    int32_t count[2] = {0, 0};
    int32_t total = 0;
  };
  // Index tokens[p] under its contexts tokens[p - d, p), d = 1..max_depth.
  void add(const int32_t* tokens, int64_t p, int32_t max_depth);
  const Entry* find(uint64_t key) const;
  void clear() {
    table_.clear();
    used_ = 0;
  }

 private:
  Entry& slot(uint64_t key);  // the key's entry, inserted if absent
  std::vector<Entry> table_;  // power-of-two size, at most half full
  std::size_t used_ = 0;
};

class SuffixProposer {
 public:
  explicit SuffixProposer(const SuffixConfig& config) : config_(config) {}

  // Index tokens[indexed, n) of request seq_id (its committed tokens grow between calls; the first
  // prompt_len are its prompt), then write up to k drafts for its next position to out; returns
  // how many.
  int32_t propose(int64_t seq_id, const int32_t* tokens, int64_t n, int64_t prompt_len, int32_t k, int32_t* out);
  // The request left: a finished one's output joins the shared cache (two generations of about
  // max_cached_tokens / 2 tokens each: the older one is dropped when the newer fills); a preempted
  // one keeps its index (its committed tokens stay).
  void forget(int64_t seq_id, bool finished);
  int64_t num_cached_tokens() const { return recent_tokens_ + older_tokens_; }

 private:
  struct Request {
    SuffixIndex index;
    std::vector<int32_t> tokens;  // indexed so far
    int64_t prompt_len = 0;
  };

  SuffixConfig config_;
  std::unordered_map<int64_t, Request> requests_;
  SuffixIndex recent_, older_;  // finished requests' outputs: the newer and the older generation
  int64_t recent_tokens_ = 0, older_tokens_ = 0;
};

}  // namespace pyengine
