// Prompt-lookup (ngram) drafting: find the most recent earlier occurrence of the sequence's last
// n tokens (n from max_n down to min_n) and propose the tokens that followed it.
#pragma once

#include <cstdint>

namespace pyengine {

// Writes up to k drafts to out and returns how many; 0 when no suffix of length min_n..max_n recurs.
int64_t propose_ngram_tokens(const int32_t* tokens, int64_t num_tokens, int32_t min_n, int32_t max_n, int32_t k,
                      int32_t* out);

}  // namespace pyengine
