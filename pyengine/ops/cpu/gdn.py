"""CPU Gated DeltaNet prefill in recurrent form: token after token through the per-token function of
gated_delta_rule_update (reference.gdn.recurrent_rows), only the final state written (to idx[n, 0]),
as the CUDA backend does. The chunked form's bits depend on where the scheduler cut the prompt; this
way a token's output and state are the same in a prefill chunk of any length, a verify row or a
decode step. Decode / verify rows run the reference, which is the same loop."""
from __future__ import annotations

import torch

from pyengine.ops.reference.gdn import recurrent_rows


def gated_delta_rule_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                             query_start_loc: torch.Tensor, state: torch.Tensor, state_idx: torch.Tensor,
                             num_accepted: torch.Tensor, has_initial_state: torch.Tensor, chunk_size: int = 64,
                             scale: float | None = None, use_qk_l2norm: bool = True) -> torch.Tensor:
    """Signature and slots as reference.gated_delta_rule_chunked; chunk_size only shapes its arithmetic."""
    return recurrent_rows(q, k, v, g, beta, state, query_start_loc, state_idx, num_accepted, has_initial_state, scale,
                          use_qk_l2norm)
