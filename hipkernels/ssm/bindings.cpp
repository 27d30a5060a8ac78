// Python bindings of the recurrent-state kernels (ssm_state.h, gated_delta_rule.h): each params struct as a class
// (pointers as integers), each launcher as name(params, stream); pyengine/ops/cuda/ssm.py fills them.
#include "common/binding_utils.h"
#include "common/register_kernels.h"
#include "ssm/gated_delta_rule.h"
#include "ssm/gdn_chunked_prefill.h"
#include "ssm/ssm_state.h"

using namespace pyengine_bindings;  // ParamsClass, def_launch

void register_ssm_kernels(py::module_& k) {
  using C = CausalConv1dParams;
  ParamsClass<C>(k, "CausalConv1dParams")
      .PE_FIELD(C, x).PE_FIELD(C, y).PE_FIELD(C, conv_state).PE_FIELD(C, weight).PE_FIELD(C, bias).PE_FIELD(C, num_rows)
      .PE_FIELD(C, query_start_loc).PE_FIELD(C, state_idx).PE_FIELD(C, num_accepted).PE_FIELD(C, has_initial_state)
      .PE_FIELD(C, dim).PE_FIELD(C, width).PE_FIELD(C, state_rows).PE_FIELD(C, slots_per_row)
      .PE_FIELD(C, x_stride_token).PE_FIELD(C, y_stride_token).PE_FIELD(C, silu).PE_FIELD(C, dtype).PE_FIELD(C, pdl);
  def_launch(k, "causal_conv1d_update", &launch_causal_conv1d_update);
  def_launch(k, "causal_conv1d_fn", &launch_causal_conv1d_fn);

  using S = SelectiveStateUpdateParams;
  ParamsClass<S>(k, "SelectiveStateUpdateParams")
      .PE_FIELD(S, state).PE_FIELD(S, x).PE_FIELD(S, dt).PE_FIELD(S, B).PE_FIELD(S, C).PE_FIELD(S, z).PE_FIELD(S, out)
      .PE_FIELD(S, A).PE_FIELD(S, D).PE_FIELD(S, dt_bias).PE_FIELD(S, query_start_loc).PE_FIELD(S, state_idx)
      .PE_FIELD(S, num_accepted).PE_FIELD(S, num_rows).PE_FIELD(S, num_heads).PE_FIELD(S, head_dim)
      .PE_FIELD(S, state_size).PE_FIELD(S, num_groups).PE_FIELD(S, slots_per_row).PE_FIELD(S, x_stride_token)
      .PE_FIELD(S, dt_stride_token).PE_FIELD(S, B_stride_token).PE_FIELD(S, C_stride_token)
      .PE_FIELD(S, z_stride_token).PE_FIELD(S, dt_softplus).PE_FIELD(S, dt_min).PE_FIELD(S, dt_max)
      .PE_FIELD(S, dtype).PE_FIELD(S, has_initial_state);
  def_launch(k, "selective_state_update", &launch_selective_state_update);
  def_launch(k, "selective_scan_prefill", &launch_selective_scan_prefill);

  using G = GatedDeltaRuleParams;
  ParamsClass<G>(k, "GatedDeltaRuleParams")
      .PE_FIELD(G, state).PE_FIELD(G, q).PE_FIELD(G, k).PE_FIELD(G, v).PE_FIELD(G, g).PE_FIELD(G, beta).PE_FIELD(G, out)
      .PE_FIELD(G, query_start_loc).PE_FIELD(G, state_idx).PE_FIELD(G, num_accepted).PE_FIELD(G, has_initial_state)
      .PE_FIELD(G, replay_dst).PE_FIELD(G, num_rows).PE_FIELD(G, num_k_heads).PE_FIELD(G, num_v_heads).PE_FIELD(G, key_dim)
      .PE_FIELD(G, value_dim).PE_FIELD(G, slots_per_row).PE_FIELD(G, q_stride_token).PE_FIELD(G, k_stride_token)
      .PE_FIELD(G, v_stride_token).PE_FIELD(G, scale).PE_FIELD(G, l2norm).PE_FIELD(G, dtype).PE_FIELD(G, grid);
  def_launch(k, "gated_delta_rule_update", &launch_gated_delta_rule_update);
  def_launch(k, "gated_delta_rule_prefill", &launch_gated_delta_rule_prefill);
  def_launch(k, "gated_delta_rule_materialise", &launch_gated_delta_rule_materialise);

  using P = GdnChunkedPrefillParams;  // chunk-wise prefill (gdn_chunked_prefill.h)
  ParamsClass<P>(k, "GdnChunkedPrefillParams")
      .PE_FIELD(P, state).PE_FIELD(P, q).PE_FIELD(P, k).PE_FIELD(P, v).PE_FIELD(P, g).PE_FIELD(P, beta).PE_FIELD(P, out)
      .PE_FIELD(P, query_start_loc).PE_FIELD(P, state_idx).PE_FIELD(P, has_initial_state).PE_FIELD(P, num_rows)
      .PE_FIELD(P, num_k_heads).PE_FIELD(P, num_v_heads).PE_FIELD(P, key_dim).PE_FIELD(P, value_dim)
      .PE_FIELD(P, state_idx_stride).PE_FIELD(P, q_stride_token).PE_FIELD(P, k_stride_token)
      .PE_FIELD(P, v_stride_token).PE_FIELD(P, scale).PE_FIELD(P, l2norm).PE_FIELD(P, dtype);
  def_launch(k, "gdn_chunked_prefill", &launch_gdn_chunked_prefill);
  k.def("gdn_chunked_prefill_chunk_size", &gdn_chunked_prefill_chunk_size);
}
