#include "ngram_proposer.h"

#include <algorithm>
#include <cstring>

namespace pyengine {

int64_t propose_ngram_tokens(const int32_t* tokens, int64_t num_tokens, int32_t min_n, int32_t max_n, int32_t k,
                      int32_t* out) {
  if (k <= 0 || min_n <= 0) return 0;
  for (int64_t n = std::min<int64_t>(max_n, num_tokens - 1); n >= min_n; --n) {
    const int32_t* suffix = tokens + num_tokens - n;
    // Scan backwards so the most recent match wins; a match must leave a token after it.
    for (int64_t start = num_tokens - n - 1; start >= 0; --start) {
      if (tokens[start] != suffix[0] || std::memcmp(tokens + start, suffix, sizeof(int32_t) * n) != 0)
        continue;
      int64_t follow = start + n;
      int64_t count = std::min<int64_t>(k, num_tokens - follow);
      std::copy_n(tokens + follow, count, out);
      return count;
    }
  }
  return 0;
}

}  // namespace pyengine
