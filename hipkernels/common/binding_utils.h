// Helpers of the kernel bindings (each family's bindings.cpp): a kernel's params struct is bound
// once, field by field, as a Python class whose device pointers read and write as integers
// (tensor.data_ptr(): no libtorch link); its launcher is bound as `launch(params, stream)`, and a
// launcher's return code becomes a Python exception.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "common/runtime.h"

namespace py = pybind11;

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

// The Python class of a params struct P: default-constructed (the struct's defaults), one
// attribute per field added with field(); pointer fields are integers.
template <typename P>
class ParamsClass {
 public:
  ParamsClass(py::module_& m, const char* name) : cls_(m, name) { cls_.def(py::init<>()); }

  template <typename T>
  ParamsClass& field(const char* name, T P::*member) {
    if constexpr (std::is_pointer_v<T>) {
      cls_.def_property(
          name, [member](const P& p) { return reinterpret_cast<std::uintptr_t>(p.*member); },
          [member](P& p, std::uintptr_t v) { p.*member = reinterpret_cast<T>(v); });
    } else {
      cls_.def_readwrite(name, member);
    }
    return *this;
  }

 private:
  py::class_<P> cls_;
};

// Binds `int launch(const P&, void* stream)` as name(params, stream), raising on a non-zero code.
template <typename P>
void def_launch(py::module_& m, const char* name, int (*launch)(const P&, void*)) {
  m.def(
      name, [name, launch](const P& p, std::uintptr_t stream) { check(launch(p, ptr<void>(stream)), name); },
      py::arg("params"), py::arg("stream"));
}

}  // namespace pyengine_bindings

// .PE_FIELD(P, x): the field P::x under its own name.
#define PE_FIELD(P, name) field(#name, &P::name)
