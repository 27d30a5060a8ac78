"""Owns the model's paged KV cache and runs one forward over a scheduled batch."""
from __future__ import annotations

import os

import numpy as np
import torch
from torch import nn

from pyengine.attention_metadata import AttentionMetadata
from pyengine.config import ModelConfig

CPU_KV_CACHE_BYTES = int(os.environ.get("PYENGINE_CPU_KV_CACHE_BYTES", 2 << 30))


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.tensor([], dtype=dtype).element_size()
    return config.num_hidden_layers * 2 * block_size * config.num_key_value_heads * config.head_dim * elem


def default_num_kv_blocks(config: ModelConfig, block_size: int, dtype: torch.dtype, device: torch.device,
                          max_num_seqs: int, max_model_len: int, gpu_memory_utilization: float) -> int:
    """Blocks that fit the memory budget, capped at what max_num_seqs full-length requests use."""
    per_block = kv_bytes_per_block(config, block_size, dtype)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = int(total * gpu_memory_utilization) - (total - free) - (1 << 30)  # 1 GiB for activations
    else:
        budget = CPU_KV_CACHE_BYTES
    most_useful = max_num_seqs * (-(-max_model_len // block_size) + 1)
    blocks = min(budget // per_block, most_useful)
    if blocks < -(-max_model_len // block_size):
        raise ValueError(f"the KV cache budget fits only {blocks} blocks of {block_size} tokens, fewer than one "
                         f"request of max_model_len={max_model_len} needs; lower max_model_len or set num_kv_blocks")
    return int(blocks)


class ModelRunner:
    def __init__(self, model: nn.Module, config: ModelConfig, block_size: int, num_kv_blocks: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        self.model, self.config, self.block_size = model, config, block_size
        self.device, self.dtype = device, dtype
        shape = (num_kv_blocks, block_size, config.num_key_value_heads, config.head_dim)
        # Unwritten slots are never read: attention reads only positions below each row's context.
        self.kv_caches = [(torch.empty(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype, device=device))
                          for _ in range(config.num_hidden_layers)]

    def _tensor(self, array: np.ndarray, dtype: torch.dtype | None = None) -> torch.Tensor:
        t = torch.from_numpy(np.ascontiguousarray(array))
        if dtype is not None:
            t = t.to(dtype)
        return t.to(self.device, non_blocking=True)

    def build_metadata(self, batch) -> AttentionMetadata:  # batch: pyengine._C.ScheduledBatch
        return AttentionMetadata(
            slot_mapping=self._tensor(batch.slot_mapping),
            block_tables=self._tensor(batch.block_tables),
            query_start_loc=self._tensor(batch.query_start_loc),
            context_lens=self._tensor(batch.context_lens),
            max_query_len=int(batch.max_query_len),
            max_context_len=int(batch.max_context_len),
            block_size=self.block_size,
        )

    @torch.inference_mode()
    def execute(self, batch) -> torch.Tensor:
        """Forward over every scheduled token; returns logits [len(logits_indices), vocab] fp32."""
        meta = self.build_metadata(batch)
        input_ids = self._tensor(batch.input_ids)
        positions = self._tensor(batch.positions)
        hidden = self.model(input_ids, positions, meta, self.kv_caches)
        index = self._tensor(batch.logits_indices, torch.int64)
        return self.model.compute_logits(hidden.index_select(0, index))
