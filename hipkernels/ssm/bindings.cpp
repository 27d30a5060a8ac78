// Thin pybind11 bindings of the recurrent-state kernels (ssm_state.h): raw device pointers and the
// current stream as integers; pyengine/ops/ssm_cuda.py validates shapes and dtypes. Registered into
// pyengine._C.kernels by register_kernels() (bindings_kernels.cpp).
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "common/binding_utils.h"
#include "common/runtime.h"
#include "ssm/ssm_state.h"

namespace py = pybind11;

namespace {

using pyengine_bindings::check;
using pyengine_bindings::ptr;

CausalConv1dParams conv_params(std::uintptr_t x, std::uintptr_t y, std::uintptr_t conv_state, std::uintptr_t weight,
                               std::uintptr_t bias, std::uintptr_t query_start_loc, std::uintptr_t state_idx,
                               std::uintptr_t num_accepted, std::uintptr_t has_initial_state, int num_rows, int dim,
                               int width, int state_rows, int slots_per_row, int64_t x_stride_token,
                               int64_t y_stride_token, bool silu, int dtype, bool pdl) {
  CausalConv1dParams p;
  p.x = ptr<const void>(x);
  p.y = ptr<void>(y);
  p.conv_state = ptr<void>(conv_state);
  p.weight = ptr<const void>(weight);
  p.bias = ptr<const void>(bias);
  p.query_start_loc = ptr<const int32_t>(query_start_loc);
  p.state_idx = ptr<const int32_t>(state_idx);
  p.num_accepted = ptr<const int32_t>(num_accepted);
  p.has_initial_state = ptr<const bool>(has_initial_state);
  p.num_rows = num_rows;
  p.dim = dim;
  p.width = width;
  p.state_rows = state_rows;
  p.slots_per_row = slots_per_row;
  p.x_stride_token = x_stride_token;
  p.y_stride_token = y_stride_token;
  p.silu = silu;
  p.dtype = dtype;
  p.pdl = pdl;
  return p;
}

}  // namespace

void register_ssm_kernels(py::module_& k) {
  auto conv_args = [](auto launch, const char* name) {
    return [launch, name](std::uintptr_t x, std::uintptr_t y, std::uintptr_t conv_state, std::uintptr_t weight,
                          std::uintptr_t bias, std::uintptr_t query_start_loc, std::uintptr_t state_idx,
                          std::uintptr_t num_accepted, std::uintptr_t has_initial_state, int num_rows, int dim,
                          int width, int state_rows, int slots_per_row, int64_t x_stride_token,
                          int64_t y_stride_token, bool silu, int dtype, std::uintptr_t stream, bool pdl) {
      CausalConv1dParams p = conv_params(x, y, conv_state, weight, bias, query_start_loc, state_idx, num_accepted,
                                         has_initial_state, num_rows, dim, width, state_rows, slots_per_row,
                                         x_stride_token, y_stride_token, silu, dtype, pdl);
      check(launch(p, ptr<void>(stream)), name);
    };
  };
  for (auto [name, launch] : {std::pair<const char*, int (*)(const CausalConv1dParams&, void*)>{
                                  "causal_conv1d_update", &launch_causal_conv1d_update},
                              {"causal_conv1d_fn", &launch_causal_conv1d_fn}}) {
    k.def(name, conv_args(launch, name), py::arg("x"), py::arg("y"), py::arg("conv_state"), py::arg("weight"),
          py::arg("bias"), py::arg("query_start_loc"), py::arg("state_idx"), py::arg("num_accepted"),
          py::arg("has_initial_state"), py::arg("num_rows"), py::arg("dim"), py::arg("width"),
          py::arg("state_rows"), py::arg("slots_per_row"), py::arg("x_stride_token"), py::arg("y_stride_token"),
          py::arg("silu"), py::arg("dtype"), py::arg("stream"), py::arg("pdl") = true);
  }

  k.def(
      "selective_state_update",
      [](std::uintptr_t state, std::uintptr_t x, std::uintptr_t dt, std::uintptr_t B, std::uintptr_t C,
         std::uintptr_t z, std::uintptr_t out, std::uintptr_t A, std::uintptr_t D, std::uintptr_t dt_bias,
         std::uintptr_t query_start_loc, std::uintptr_t state_idx, std::uintptr_t num_accepted, int num_rows,
         int num_heads, int head_dim, int state_size, int num_groups, int slots_per_row, int64_t x_stride_token,
         int64_t dt_stride_token, int64_t B_stride_token, int64_t C_stride_token, int64_t z_stride_token,
         bool dt_softplus, float dt_min, float dt_max, int dtype, std::uintptr_t stream,
         std::uintptr_t has_initial_state, bool prefill) {
        SelectiveStateUpdateParams p;
        p.state = ptr<float>(state);
        p.x = ptr<const void>(x);
        p.dt = ptr<const void>(dt);
        p.B = ptr<const void>(B);
        p.C = ptr<const void>(C);
        p.z = ptr<const void>(z);
        p.out = ptr<void>(out);
        p.A = ptr<const float>(A);
        p.D = ptr<const float>(D);
        p.dt_bias = ptr<const float>(dt_bias);
        p.query_start_loc = ptr<const int32_t>(query_start_loc);
        p.state_idx = ptr<const int32_t>(state_idx);
        p.num_accepted = ptr<const int32_t>(num_accepted);
        p.num_rows = num_rows;
        p.num_heads = num_heads;
        p.head_dim = head_dim;
        p.state_size = state_size;
        p.num_groups = num_groups;
        p.slots_per_row = slots_per_row;
        p.x_stride_token = x_stride_token;
        p.dt_stride_token = dt_stride_token;
        p.B_stride_token = B_stride_token;
        p.C_stride_token = C_stride_token;
        p.z_stride_token = z_stride_token;
        p.dt_softplus = dt_softplus;
        p.dt_min = dt_min;
        p.dt_max = dt_max;
        p.dtype = dtype;
        p.has_initial_state = ptr<const bool>(has_initial_state);
        if (prefill)
          check(launch_selective_scan_prefill(p, ptr<void>(stream)), "selective_scan_prefill");
        else
          check(launch_selective_state_update(p, ptr<void>(stream)), "selective_state_update");
      },
      py::arg("state"), py::arg("x"), py::arg("dt"), py::arg("B"), py::arg("C"), py::arg("z"), py::arg("out"),
      py::arg("A"), py::arg("D"), py::arg("dt_bias"), py::arg("query_start_loc"), py::arg("state_idx"),
      py::arg("num_accepted"), py::arg("num_rows"), py::arg("num_heads"), py::arg("head_dim"),
      py::arg("state_size"), py::arg("num_groups"), py::arg("slots_per_row"), py::arg("x_stride_token"),
      py::arg("dt_stride_token"), py::arg("B_stride_token"), py::arg("C_stride_token"), py::arg("z_stride_token"),
      py::arg("dt_softplus"), py::arg("dt_min"), py::arg("dt_max"), py::arg("dtype"), py::arg("stream"),
      py::arg("has_initial_state") = 0, py::arg("prefill") = false);
}
