// Python bindings of the per-token layer ops (layer_ops.h): each params struct as a class (pointers
// as integers), each launcher as name(params, stream); pyengine/ops/cuda/layer.py fills them.
#include "common/binding_utils.h"
#include "common/register_kernels.h"
#include "layer_ops/layer_ops.h"

using namespace pyengine_bindings;  // ParamsClass, def_launch

void register_layer_ops_kernels(py::module_& k) {
  using N = RmsNormParams;
  ParamsClass<N>(k, "RmsNormParams")
      .PE_FIELD(N, x).PE_FIELD(N, residual).PE_FIELD(N, weight).PE_FIELD(N, out).PE_FIELD(N, num_tokens)
      .PE_FIELD(N, hidden).PE_FIELD(N, x_stride).PE_FIELD(N, residual_stride).PE_FIELD(N, out_stride)
      .PE_FIELD(N, eps).PE_FIELD(N, dtype);
  def_launch(k, "rms_norm", &launch_rms_norm);
  def_launch(k, "fused_add_rms_norm", &launch_fused_add_rms_norm);

  using S = SiluAndMulParams;
  ParamsClass<S>(k, "SiluAndMulParams")
      .PE_FIELD(S, x).PE_FIELD(S, out).PE_FIELD(S, num_tokens).PE_FIELD(S, inter).PE_FIELD(S, x_stride)
      .PE_FIELD(S, out_stride).PE_FIELD(S, dtype);
  def_launch(k, "silu_and_mul", &launch_silu_and_mul);

  using R = RopeAndCacheParams;
  ParamsClass<R>(k, "RopeAndCacheParams")
      .PE_FIELD(R, qk).PE_FIELD(R, v).PE_FIELD(R, cos).PE_FIELD(R, sin).PE_FIELD(R, k_cache).PE_FIELD(R, v_cache)
      .PE_FIELD(R, slot_mapping).PE_FIELD(R, num_tokens).PE_FIELD(R, num_q_heads).PE_FIELD(R, num_kv_heads)
      .PE_FIELD(R, head_dim).PE_FIELD(R, qk_stride_token).PE_FIELD(R, qk_stride_head).PE_FIELD(R, v_stride_token)
      .PE_FIELD(R, v_stride_head).PE_FIELD(R, cos_stride_token).PE_FIELD(R, sin_stride_token).PE_FIELD(R, dtype);
  def_launch(k, "rope_and_cache", &launch_rope_and_cache);
}
