// Small runtime helpers shared by the kernel bindings (plain C++ interface).
#pragma once

#include <cstddef>

const char* pe_error_string(int code);

// An asynchronous copy of `bytes` on `stream` (any direction: the runtime tells host from device by
// the unified addresses; a pinned host side keeps it asynchronous), then, if `event` is not null,
// that event recorded behind it: the engine's per-step copies in one call from Python
// (pyengine/ops/streams.py). 0 or the runtime's error code.
int pe_copy_async(void* dst, const void* src, size_t bytes, void* event, void* stream);
