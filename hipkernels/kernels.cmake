# GPU kernels of hipkernels/ (HIP dialect, compiled here as CUDA for sm_90a) linked into _C.
# Included by the root CMakeLists.txt. PYENGINE_KERNELS: AUTO (build when nvcc is found), ON
# (require it), OFF (core only: nothing here runs).
if(PYENGINE_KERNELS STREQUAL "OFF")
  message(STATUS "pyengine: GPU kernels disabled (PYENGINE_KERNELS=OFF)")
  return()
endif()

if(NOT DEFINED CMAKE_CUDA_COMPILER AND NOT DEFINED ENV{CUDACXX} AND EXISTS /usr/local/cuda/bin/nvcc)
  find_program(_PYENGINE_NVCC nvcc)
  if(NOT _PYENGINE_NVCC)
    set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
  endif()
endif()

include(CheckLanguage)
check_language(CUDA)
if(NOT CMAKE_CUDA_COMPILER)
  if(PYENGINE_KERNELS STREQUAL "ON")
    message(FATAL_ERROR "pyengine: PYENGINE_KERNELS=ON but no CUDA compiler was found")
  endif()
  message(STATUS "pyengine: no CUDA compiler found, GPU kernels not built")
  return()
endif()

enable_language(CUDA)
find_package(CUDAToolkit REQUIRED)
message(STATUS "pyengine: building GPU kernels with ${CMAKE_CUDA_COMPILER} for sm_90a")

set(_PYENGINE_KDIR ${CMAKE_CURRENT_SOURCE_DIR}/hipkernels)
# One folder per kernel family (attention, gemm, layer_ops, ssm) plus common/; includes are relative
# to hipkernels/ ("common/hip_compat.h").
file(GLOB_RECURSE PYENGINE_KERNEL_SOURCES CONFIGURE_DEPENDS ${_PYENGINE_KDIR}/*.hip)
file(GLOB_RECURSE PYENGINE_KERNEL_BINDINGS CONFIGURE_DEPENDS ${_PYENGINE_KDIR}/*.cpp)
set_source_files_properties(${PYENGINE_KERNEL_SOURCES} PROPERTIES LANGUAGE CUDA)

add_library(pyengine_kernels OBJECT ${PYENGINE_KERNEL_SOURCES})
set_target_properties(pyengine_kernels PROPERTIES
  CUDA_ARCHITECTURES OFF
  CUDA_STANDARD 17
  CUDA_STANDARD_REQUIRED ON
  POSITION_INDEPENDENT_CODE ON)
target_include_directories(pyengine_kernels PRIVATE ${_PYENGINE_KDIR})
target_compile_options(pyengine_kernels PRIVATE
  $<$<COMPILE_LANGUAGE:CUDA>:-x cu -gencode=arch=compute_90a,code=sm_90a -O3 --expt-relaxed-constexpr>)

target_sources(_C PRIVATE ${PYENGINE_KERNEL_BINDINGS} $<TARGET_OBJECTS:pyengine_kernels>)
# common/ too: csrc/core/bindings.cpp includes "register_kernels.h" by its bare name.
target_include_directories(_C PRIVATE ${_PYENGINE_KDIR} ${_PYENGINE_KDIR}/common)
target_compile_definitions(_C PRIVATE PYENGINE_WITH_KERNELS)
target_link_libraries(_C PRIVATE CUDA::cudart_static)
