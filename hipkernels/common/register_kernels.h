// Entry point of the GPU kernel bindings. csrc/core/bindings.cpp calls register_kernels(m) under
// #ifdef PYENGINE_WITH_KERNELS (defined by hipkernels/kernels.cmake when the kernels are built).
#pragma once

#include <pybind11/pybind11.h>

// Adds the submodule pyengine._C.kernels (raw pointers and streams in, no libtorch).
void register_kernels(pybind11::module_& m);

// One per kernel family, each defined in the family's bindings.cpp.
void register_attention_kernels(pybind11::module_& k);
void register_layer_ops_kernels(pybind11::module_& k);
void register_gemm_kernels(pybind11::module_& k);
void register_ssm_kernels(pybind11::module_& k);
void register_sampling_kernels(pybind11::module_& k);
void register_spec_kernels(pybind11::module_& k);
