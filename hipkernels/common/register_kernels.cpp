// pyengine._C.kernels: every kernel family's launchers and params structs in one submodule.
#include "common/register_kernels.h"

void register_kernels(pybind11::module_& m) {
  pybind11::module_ k = m.def_submodule("kernels", "GPU kernels (raw device pointers and streams)");
  register_attention_kernels(k);
  register_layer_ops_kernels(k);
  register_gemm_kernels(k);
  register_ssm_kernels(k);
  register_sampling_kernels(k);
}
