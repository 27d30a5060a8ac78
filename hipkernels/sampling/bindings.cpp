// Python bindings of greedy_rows (greedy_rows.h): the params struct as a class (pointers as
// integers), the launcher as greedy_rows(params, stream); pyengine/ops/cuda/sampling.py fills it.
#include "common/binding_utils.h"
#include "common/register_kernels.h"
#include "sampling/greedy_rows.h"

using namespace pyengine_bindings;  // ParamsClass, def_launch

void register_sampling_kernels(py::module_& k) {
  using G = GreedyRowsParams;
  ParamsClass<G>(k, "GreedyRowsParams")
      .PE_FIELD(G, logits).PE_FIELD(G, out).PE_FIELD(G, num_rows).PE_FIELD(G, vocab).PE_FIELD(G, row_stride);
  def_launch(k, "greedy_rows", &launch_greedy_rows);
}
