// Suffix decoding: drafts from the continuations that followed the longest recurring suffix of a
// request's tokens, in that request (prompt and output so far) and in a bounded cache of recently
// finished requests' tokens (agentic and code-edit traffic repeats earlier answers).
//
// Each history (suffix_history.h) finds the newest occurrences of the request's last tokens and how
// far back each matches (up to max_depth). A draft is the most frequent continuation among the
// occurrences of the longest match (the request's own history first on a tie of match length, then
// the newer cache generation; among equally frequent tokens the newest occurrence's); the chain
// goes on from those occurrences' successors - a search again where none continues - and stops at k
// drafts, at max_spec_factor x the first match length, or when the chosen token followed less than
// min_token_prob of the longest matches. Drafts are only proposals: the target verifies every one.
#pragma once

#include <cstddef>
#include <cstdint>
#include <unordered_map>
#include <vector>

#include "suffix_history.h"

namespace pyengine {

struct SuffixConfig {
  int32_t max_depth = 24;           // longest context indexed
  float max_spec_factor = 1.0f;     // drafts per matched context token
  float min_token_prob = 0.1f;      // stop below this share of the context's continuations
  int64_t max_cached_tokens = 1 << 20;  // finished requests' tokens kept in the global index
};

class SuffixProposer {
 public:
  explicit SuffixProposer(const SuffixConfig& config) : config_(config) {}

  // Index tokens[indexed, n) of request seq_id (its committed tokens grow between calls; the first
  // prompt_len are its prompt), then write up to k drafts for its next position to out; returns
  // how many.
  int32_t propose(int64_t seq_id, const int32_t* tokens, int64_t n, int64_t prompt_len, int32_t k, int32_t* out);
  // For a step launched before this one's result: the tokens that would follow tokens[0, n) and
  // the in-flight drafts ext[0, m) if every draft is accepted (the first: the token the target is
  // expected to add after them, then its drafts), up to k, written to out; returns how many.
  // Indexes tokens[indexed, n) as propose does; ext is not committed and stays out of the index.
  int32_t predict(int64_t seq_id, const int32_t* tokens, int64_t n, int64_t prompt_len, const int32_t* ext, int32_t m,
                  int32_t k, int32_t* out);
  // The request left: a finished one's output joins the shared cache (two generations of about
  // max_cached_tokens / 2 tokens each: the older one is dropped when the newer fills); a preempted
  // one keeps its index (its committed tokens stay).
  void forget(int64_t seq_id, bool finished);
  int64_t num_cached_tokens() const { return recent_tokens_ + older_tokens_; }

 private:
  struct Request {
    SuffixHistory history;  // its committed tokens indexed so far
    int64_t prompt_len = 0;
  };

  Request& index(int64_t seq_id, const int32_t* tokens, int64_t n, int64_t prompt_len);
  // The draft chain after ctx (the last max_depth tokens of a context), up to k tokens.
  int32_t chain(const Request& r, std::vector<int32_t> ctx, int32_t k, int32_t* out);

  SuffixConfig config_;
  std::unordered_map<int64_t, Request> requests_;
  // Finished requests' outputs, each after up to max_depth tokens of its prompt and a separator:
  // the newer and the older generation.
  SuffixHistory recent_, older_;
  std::vector<SuffixHistory::Candidate> found_[3], next_;  // per-call scratch
  int64_t recent_tokens_ = 0, older_tokens_ = 0;
};

}  // namespace pyengine
