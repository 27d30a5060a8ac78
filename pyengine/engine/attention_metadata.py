"""Per-step attention metadata: built once by the model runner from the scheduler's flat arrays,
read by every attention layer (nano-vllm style: one small dataclass instead of a dozen arguments).

Rows are requests scheduled this step. Row r owns query tokens
[query_start_loc[r], query_start_loc[r+1]) of the flat token batch; they sit at the last
q_len positions of a context of context_lens[r] tokens (the new tokens included). Query i of a
row (0-based inside the row) attends causally to keys [0, context_lens[r] - (q_len - 1 - i)).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64; KV slot = block_id * block_size + offset; -1 = no write
    block_tables: torch.Tensor  # [num_rows, max_blocks] int32; -1 pads unused entries
    query_start_loc: torch.Tensor  # [num_rows + 1] int32, cumulative query lengths
    context_lens: torch.Tensor  # [num_rows] int32, KV length after this step (new tokens included)
    max_query_len: int
    max_context_len: int
    block_size: int
    # Derived tensors an implementation computes once per step and reuses in every layer
    # (e.g. the CPU reference's gather indices and mask). Keyed by the implementation.
    cache: dict[str, Any] = field(default_factory=dict)

    @property
    def num_rows(self) -> int:
        return int(self.context_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])
