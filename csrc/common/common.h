// Small shared helpers of the C++ core: error reporting that pybind11 maps to Python exceptions.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>

namespace pyengine {

// Misuse by the caller (unknown id, double free, bad argument): surfaces as ValueError.
[[noreturn]] inline void raise_value_error(const std::string& msg) { throw std::invalid_argument(msg); }

// Resource exhaustion the caller should have checked for (allocating without can_allocate):
// surfaces as pyengine._C.NoFreeBlocksError (a RuntimeError).
struct NoFreeBlocksError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Message building without iostreams: on the GPU machine (GCC 13 under the Python of its torch
// image) formatting through std::ostringstream crashed the process whenever an error message was
// built, so a ValueError became a segfault; std::to_string and appends need no stream or locale.
inline void append_to(std::string& s, std::string_view v) { s += v; }
inline void append_to(std::string& s, char v) { s += v; }
template <typename T, typename = std::enable_if_t<std::is_arithmetic_v<T>>>
inline void append_to(std::string& s, T v) { s += std::to_string(v); }

template <typename... Args>
std::string concat(const Args&... args) {
  std::string s;
  (append_to(s, args), ...);
  return s;
}

#define PE_CHECK(cond, ...)                                         \
  do {                                                              \
    if (!(cond)) ::pyengine::raise_value_error(::pyengine::concat(__VA_ARGS__)); \
  } while (0)

// Internal invariant: a failure is a bug in pyengine, never the caller's fault.
#define PE_ASSERT(cond)                                                                      \
  do {                                                                                       \
    if (!(cond))                                                                             \
      throw std::logic_error(::pyengine::concat("pyengine internal invariant violated: ", #cond, \
                                                " at ", __FILE__, ":", __LINE__));           \
  } while (0)

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace pyengine
