// Python bindings of the GEMMs (skinny_gemm.h, invariant_gemm.h, invariant_gemm_f32.h): each params
// struct as a class (pointers as integers), launched as skinny_gemm / invariant_gemm /
// invariant_gemm_f32(params, stream);
// pyengine/ops/cuda/gemm.py fills them.
#include "common/binding_utils.h"
#include "common/register_kernels.h"
#include "gemm/grouped_gemm.h"
#include "gemm/invariant_gemm.h"
#include "gemm/invariant_gemm_f32.h"
#include "gemm/skinny_gemm.h"

using namespace pyengine_bindings;  // ParamsClass, def_launch

void register_gemm_kernels(py::module_& k) {
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
  using I = InvariantGemmParams;
  ParamsClass<I>(k, "InvariantGemmParams")
      .PE_FIELD(I, x).PE_FIELD(I, w).PE_FIELD(I, bias).PE_FIELD(I, y).PE_FIELD(I, m).PE_FIELD(I, n).PE_FIELD(I, k)
      .PE_FIELD(I, x_stride).PE_FIELD(I, y_stride).PE_FIELD(I, dtype).PE_FIELD(I, num_sms).PE_FIELD(I, split)
      .PE_FIELD(I, pdl).PE_FIELD(I, tile_m).PE_FIELD(I, tile_n).PE_FIELD(I, family);
  def_launch(k, "invariant_gemm", &launch_invariant_gemm);
  k.def("invariant_gemm_split", &invariant_gemm_split, py::arg("k"), py::arg("n"), py::arg("num_sms"),
        "The K split of the batch-invariant GEMM for a shape (a function of K, N and the device, never of M).");
  using F = InvariantGemmF32Params;
  ParamsClass<F>(k, "InvariantGemmF32Params")
      .PE_FIELD(F, x).PE_FIELD(F, w).PE_FIELD(F, bias).PE_FIELD(F, y).PE_FIELD(F, workspace).PE_FIELD(F, m)
      .PE_FIELD(F, n).PE_FIELD(F, k).PE_FIELD(F, x_stride).PE_FIELD(F, y_stride).PE_FIELD(F, num_sms)
      .PE_FIELD(F, split);
  def_launch(k, "invariant_gemm_f32", &launch_invariant_gemm_f32);
  k.def("invariant_gemm_f32_split", &invariant_gemm_f32_split, py::arg("k"), py::arg("n"), py::arg("num_sms"),
        "The K split of the batch-invariant fp32 GEMM for a shape (a function of K, N and the device, never of M).");
  k.def("invariant_gemm_f32_workspace", &invariant_gemm_f32_workspace, py::arg("m"), py::arg("n"), py::arg("k"),
        py::arg("num_sms"), py::arg("split"), "fp32 elements of workspace an fp32 invariant GEMM launch needs (0: none).");
  using GG = GroupedGemmParams;  // grouped_gemm.h: the invariant GEMM over row groups (MoE experts, heads)
  ParamsClass<GG>(k, "GroupedGemmParams")
      .PE_FIELD(GG, x).PE_FIELD(GG, w).PE_FIELD(GG, y).PE_FIELD(GG, offs).PE_FIELD(GG, num_groups).PE_FIELD(GG, m)
      .PE_FIELD(GG, n).PE_FIELD(GG, k).PE_FIELD(GG, x_stride).PE_FIELD(GG, y_stride).PE_FIELD(GG, x_group_stride)
      .PE_FIELD(GG, y_group_stride).PE_FIELD(GG, dtype).PE_FIELD(GG, num_sms).PE_FIELD(GG, split).PE_FIELD(GG, pdl);
  def_launch(k, "grouped_gemm", &launch_grouped_gemm);
}
