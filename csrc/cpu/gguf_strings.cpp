#include "gguf_strings.h"

#include <cstring>

namespace pyengine::cpu {

int64_t gguf_string_starts(const uint8_t* base, int64_t size, int64_t pos, int64_t count, int64_t* starts) {
  if (pos < 0 || pos > size || count < 0) return -1;
  for (int64_t i = 0; i < count; ++i) {
    if (size - pos < 8) return -1;
    uint64_t n;
    std::memcpy(&n, base + pos, sizeof(n));  // unaligned; GGUF is little-endian, as every host here
    pos += 8;
    if (n > static_cast<uint64_t>(size - pos)) return -1;  // compared before adding: no overflow
    starts[i] = pos;
    pos += static_cast<int64_t>(n);
  }
  return pos;
}

}  // namespace pyengine::cpu
