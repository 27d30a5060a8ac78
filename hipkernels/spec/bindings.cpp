// Python bindings of next_verify_step (next_verify_step.h): the params struct as a class (pointers
// as integers), the launcher as next_verify_step(params, stream); pyengine/ops/cuda/next_verify_step.py
// fills it.
#include "common/binding_utils.h"
#include "common/register_kernels.h"
#include "spec/next_verify_step.h"

using namespace pyengine_bindings;  // ParamsClass, def_launch

void register_spec_kernels(py::module_& k) {
  using P = NextVerifyStepParams;
  ParamsClass<P>(k, "NextVerifyStepParams")
      .PE_FIELD(P, argmax).PE_FIELD(P, rows_in).PE_FIELD(P, sync_tokens).PE_FIELD(P, history)
      .PE_FIELD(P, history_stride).PE_FIELD(P, block_tables).PE_FIELD(P, table_width).PE_FIELD(P, block_size)
      .PE_FIELD(P, max_context).PE_FIELD(P, inputs).PE_FIELD(P, token_capacity).PE_FIELD(P, row_capacity)
      .PE_FIELD(P, rows).PE_FIELD(P, padded_rows).PE_FIELD(P, q).PE_FIELD(P, token_slots)
      .PE_FIELD(P, max_drafts).PE_FIELD(P, result).PE_FIELD(P, result_stride).PE_FIELD(P, min_n)
      .PE_FIELD(P, max_n).PE_FIELD(P, phase).PE_FIELD(P, layer_drafts).PE_FIELD(P, layer_stride);
  def_launch(k, "next_verify_step", &launch_next_verify_step);
}
