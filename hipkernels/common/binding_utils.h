// Helpers shared by the kernel bindings (bindings_kernels.cpp, bindings_ssm.cpp): device pointers
// arrive from Python as integers, and a launcher's return code becomes a Python exception.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

#include "common/runtime.h"

namespace pyengine_bindings {

template <typename T>
T* ptr(std::uintptr_t p) {
  return reinterpret_cast<T*>(p);
}

// rc < 0: a configuration the kernels do not support (ValueError); rc > 0: a device error.
inline void check(int rc, const char* what) {
  if (rc == 0) return;
  if (rc < 0) throw std::invalid_argument(std::string(what) + ": unsupported configuration");
  throw std::runtime_error(std::string(what) + ": " + pe_error_string(rc));
}

}  // namespace pyengine_bindings
