// Python binding of the skinny GEMM (skinny_gemm.h): SkinnyGemmParams as a class (pointers as
// integers), launched as skinny_gemm(params, stream); pyengine/ops/cuda/gemm.py fills it.
#include "common/binding_utils.h"
#include "common/register_kernels.h"
#include "gemm/skinny_gemm.h"

using namespace pyengine_bindings;  // ParamsClass, def_launch

void register_skinny_gemm_kernels(py::module_& k) {
  using G = SkinnyGemmParams;
  ParamsClass<G>(k, "SkinnyGemmParams")
      .PE_FIELD(G, x).PE_FIELD(G, w).PE_FIELD(G, bias).PE_FIELD(G, y).PE_FIELD(G, m).PE_FIELD(G, n).PE_FIELD(G, k)
      .PE_FIELD(G, x_stride).PE_FIELD(G, y_stride).PE_FIELD(G, dtype).PE_FIELD(G, num_sms).PE_FIELD(G, split)
      .PE_FIELD(G, tile_n).PE_FIELD(G, pdl).PE_FIELD(G, prefetch).PE_FIELD(G, prefetch_bytes);
  def_launch(k, "skinny_gemm", &launch_skinny_gemm);
  k.def("skinny_gemm_tile_n", &skinny_gemm_tile_n, py::arg("n"), py::arg("num_sms"),
        "The default output columns per block of the skinny GEMM for N (a function of N and the device).");
  k.def("skinny_gemm_split", &skinny_gemm_split, py::arg("k"), py::arg("n"), py::arg("tile_n"), py::arg("num_sms"),
        "The default K split of the skinny GEMM for a shape (a function of K, N and the device only).");
}
