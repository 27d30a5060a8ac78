// Entry point of the GPU kernel bindings. csrc/core/bindings.cpp calls register_kernels(m) under
// #ifdef PYENGINE_WITH_KERNELS (defined by hipkernels/kernels.cmake when the kernels are built).
#pragma once

#include <pybind11/pybind11.h>

// Adds the submodule pyengine._C.kernels (raw pointers and streams in, no libtorch).
void register_kernels(pybind11::module_& m);
