// Thin pybind11 binding of the skinny GEMM (skinny_gemm.h): raw device pointers and the current
// stream as integers; pyengine/ops/cuda.py validates shapes, dtypes and alignment. Registered
// into pyengine._C.kernels by register_kernels() (bindings_kernels.cpp).
#include <pybind11/pybind11.h>

#include <cstdint>

#include "common/binding_utils.h"
#include "gemm/skinny_gemm.h"

namespace py = pybind11;

void register_skinny_gemm_kernels(py::module_& k) {
  using pyengine_bindings::check;
  using pyengine_bindings::ptr;
  k.def(
      "skinny_gemm",
      [](std::uintptr_t x, std::uintptr_t w, std::uintptr_t bias, std::uintptr_t y, int m, int n, int kdim,
         int64_t x_stride, int64_t y_stride, int dtype, int num_sms, int split, int tile_n, bool pdl,
         std::uintptr_t prefetch, int64_t prefetch_bytes, std::uintptr_t stream) {
        SkinnyGemmParams p;
        p.x = ptr<const void>(x);
        p.w = ptr<const void>(w);
        p.bias = ptr<const void>(bias);
        p.y = ptr<void>(y);
        p.m = m;
        p.n = n;
        p.k = kdim;
        p.x_stride = x_stride;
        p.y_stride = y_stride;
        p.dtype = dtype;
        p.num_sms = num_sms;
        p.split = split;
        p.tile_n = tile_n;
        p.pdl = pdl;
        p.prefetch = ptr<const void>(prefetch);
        p.prefetch_bytes = prefetch_bytes;
        check(launch_skinny_gemm(p, ptr<void>(stream)), "skinny_gemm");
      },
      py::arg("x"), py::arg("w"), py::arg("bias"), py::arg("y"), py::arg("m"), py::arg("n"), py::arg("k"),
      py::arg("x_stride"), py::arg("y_stride"), py::arg("dtype"), py::arg("num_sms"), py::arg("split"),
      py::arg("tile_n"), py::arg("pdl"), py::arg("prefetch"), py::arg("prefetch_bytes"), py::arg("stream"));
  k.def("skinny_gemm_tile_n", &skinny_gemm_tile_n, py::arg("n"), py::arg("num_sms"),
        "The default output columns per block of the skinny GEMM for N (a function of N and the device).");
  k.def("skinny_gemm_split", &skinny_gemm_split, py::arg("k"), py::arg("n"), py::arg("tile_n"), py::arg("num_sms"),
        "The default K split of the skinny GEMM for a shape (a function of K, N and the device only).");
}
