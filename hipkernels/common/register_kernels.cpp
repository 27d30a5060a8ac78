// pyengine._C.kernels: every kernel family's launchers and params structs in one submodule, and the
// runtime's per-step copy (runtime.h).
#include "common/register_kernels.h"

#include "common/binding_utils.h"

void register_kernels(pybind11::module_& m) {
  pybind11::module_ k = m.def_submodule("kernels", "GPU kernels (raw device pointers and streams)");
  register_attention_kernels(k);
  register_layer_ops_kernels(k);
  register_gemm_kernels(k);
  register_ssm_kernels(k);
  register_sampling_kernels(k);
  register_spec_kernels(k);
  k.def(
      "copy_async",
      [](std::uintptr_t dst, std::uintptr_t src, std::size_t bytes, std::uintptr_t event, std::uintptr_t stream) {
        pyengine_bindings::check(pe_copy_async(pyengine_bindings::ptr<void>(dst), pyengine_bindings::ptr<const void>(src),
                                               bytes, pyengine_bindings::ptr<void>(event),
                                               pyengine_bindings::ptr<void>(stream)),
                                 "copy_async");
      },
      py::arg("dst"), py::arg("src"), py::arg("bytes"), py::arg("event"), py::arg("stream"),
      "An asynchronous copy on a stream, then an event recorded there (0: none): runtime.h pe_copy_async.");
}
