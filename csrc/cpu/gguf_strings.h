// Where the strings of a GGUF string array lie: the one sequential walk of a metadata parse (a
// vocabulary and its merges: ~100k strings), done here because each string's position depends on
// every length before it, which numpy cannot vectorise (in Python it was ~40 ms per load).
#pragma once

#include <cstdint>

namespace pyengine::cpu {

// Walks `count` strings (a little-endian uint64 byte length, then the bytes) from offset `pos` of
// the `size` bytes at `base`, writing each body's offset to starts[i]. Returns the offset just past
// the last body, or -1 where a length or a body runs past `size` (starts then partly written).
int64_t gguf_string_starts(const uint8_t* base, int64_t size, int64_t pos, int64_t count, int64_t* starts);

}  // namespace pyengine::cpu
