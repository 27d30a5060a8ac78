// Thin pybind11 bindings of the per-token layer ops (layer_ops.h): raw device pointers and the
// current stream as integers; pyengine/ops/cuda.py validates shapes and dtypes. Registered into
// pyengine._C.kernels by register_kernels() (bindings_kernels.cpp).
#include <pybind11/pybind11.h>

#include <cstdint>

#include "common/binding_utils.h"
#include "layer_ops/layer_ops.h"

namespace py = pybind11;

namespace {

using pyengine_bindings::check;
using pyengine_bindings::ptr;

RmsNormParams norm_params(std::uintptr_t x, std::uintptr_t residual, std::uintptr_t weight, std::uintptr_t out,
                          int64_t num_tokens, int hidden, int64_t x_stride, int64_t residual_stride,
                          int64_t out_stride, float eps, int dtype) {
  RmsNormParams p;
  p.x = ptr<const void>(x);
  p.residual = ptr<void>(residual);
  p.weight = ptr<const void>(weight);
  p.out = ptr<void>(out);
  p.num_tokens = num_tokens;
  p.hidden = hidden;
  p.x_stride = x_stride;
  p.residual_stride = residual_stride;
  p.out_stride = out_stride;
  p.eps = eps;
  p.dtype = dtype;
  return p;
}

}  // namespace

void register_layer_ops_kernels(py::module_& k) {
  k.def(
      "rms_norm",
      [](std::uintptr_t x, std::uintptr_t weight, std::uintptr_t out, int64_t num_tokens, int hidden,
         int64_t x_stride, int64_t out_stride, float eps, int dtype, std::uintptr_t stream) {
        const RmsNormParams p = norm_params(x, 0, weight, out, num_tokens, hidden, x_stride, 0, out_stride, eps, dtype);
        check(launch_rms_norm(p, ptr<void>(stream)), "rms_norm");
      },
      py::arg("x"), py::arg("weight"), py::arg("out"), py::arg("num_tokens"), py::arg("hidden"), py::arg("x_stride"),
      py::arg("out_stride"), py::arg("eps"), py::arg("dtype"), py::arg("stream"));

  k.def(
      "fused_add_rms_norm",
      [](std::uintptr_t x, std::uintptr_t residual, std::uintptr_t weight, int64_t num_tokens, int hidden,
         int64_t x_stride, int64_t residual_stride, float eps, int dtype, std::uintptr_t stream) {
        const RmsNormParams p =
            norm_params(x, residual, weight, x, num_tokens, hidden, x_stride, residual_stride, x_stride, eps, dtype);
        check(launch_fused_add_rms_norm(p, ptr<void>(stream)), "fused_add_rms_norm");
      },
      py::arg("x"), py::arg("residual"), py::arg("weight"), py::arg("num_tokens"), py::arg("hidden"),
      py::arg("x_stride"), py::arg("residual_stride"), py::arg("eps"), py::arg("dtype"), py::arg("stream"));

  k.def(
      "silu_and_mul",
      [](std::uintptr_t x, std::uintptr_t out, int64_t num_tokens, int inter, int64_t x_stride, int64_t out_stride,
         int dtype, std::uintptr_t stream) {
        SiluAndMulParams p;
        p.x = ptr<const void>(x);
        p.out = ptr<void>(out);
        p.num_tokens = num_tokens;
        p.inter = inter;
        p.x_stride = x_stride;
        p.out_stride = out_stride;
        p.dtype = dtype;
        check(launch_silu_and_mul(p, ptr<void>(stream)), "silu_and_mul");
      },
      py::arg("x"), py::arg("out"), py::arg("num_tokens"), py::arg("inter"), py::arg("x_stride"),
      py::arg("out_stride"), py::arg("dtype"), py::arg("stream"));

  k.def(
      "rope_and_cache",
      [](std::uintptr_t qk, std::uintptr_t v, std::uintptr_t cos, std::uintptr_t sin, std::uintptr_t k_cache,
         std::uintptr_t v_cache, std::uintptr_t slot_mapping, int64_t num_tokens, int num_q_heads, int num_kv_heads,
         int head_dim, int64_t qk_stride_token, int64_t qk_stride_head, int64_t v_stride_token,
         int64_t v_stride_head, int64_t cos_stride_token, int64_t sin_stride_token, int dtype,
         std::uintptr_t stream) {
        RopeAndCacheParams p;
        p.qk = ptr<void>(qk);
        p.v = ptr<const void>(v);
        p.cos = ptr<const void>(cos);
        p.sin = ptr<const void>(sin);
        p.k_cache = ptr<void>(k_cache);
        p.v_cache = ptr<void>(v_cache);
        p.slot_mapping = ptr<const int64_t>(slot_mapping);
        p.num_tokens = num_tokens;
        p.num_q_heads = num_q_heads;
        p.num_kv_heads = num_kv_heads;
        p.head_dim = head_dim;
        p.qk_stride_token = qk_stride_token;
        p.qk_stride_head = qk_stride_head;
        p.v_stride_token = v_stride_token;
        p.v_stride_head = v_stride_head;
        p.cos_stride_token = cos_stride_token;
        p.sin_stride_token = sin_stride_token;
        p.dtype = dtype;
        check(launch_rope_and_cache(p, ptr<void>(stream)), "rope_and_cache");
      },
      py::arg("qk"), py::arg("v"), py::arg("cos"), py::arg("sin"), py::arg("k_cache"), py::arg("v_cache"),
      py::arg("slot_mapping"), py::arg("num_tokens"), py::arg("num_q_heads"), py::arg("num_kv_heads"),
      py::arg("head_dim"), py::arg("qk_stride_token"), py::arg("qk_stride_head"), py::arg("v_stride_token"),
      py::arg("v_stride_head"), py::arg("cos_stride_token"), py::arg("sin_stride_token"), py::arg("dtype"),
      py::arg("stream"));
}
