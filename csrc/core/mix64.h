// The hash mixer the prefix cache and the suffix proposer share: splitmix64's finaliser, a cheap,
// well-distributed 64-bit mixer.
#pragma once

#include <cstdint>

namespace pyengine {

inline uint64_t mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return x;
}

}  // namespace pyengine
