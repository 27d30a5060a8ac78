"""How many KV blocks the pool gets: the one place that turns a memory budget into blocks."""
from __future__ import annotations

import torch

from pyengine.config import ModelConfig

CPU_KV_CACHE_BYTES = 2 << 30  # default CPU budget; LLM(cpu_kv_cache_bytes=...) overrides it
ACTIVATION_RESERVE_BYTES = 1 << 30  # GPU memory left for activations and workspaces


def kv_bytes_per_block(configs: list[ModelConfig], block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block costs in every cache that shares the block pool (the target's, and a draft
    model's, which writes the same slots)."""
    elem = torch.tensor([], dtype=dtype).element_size()
    return block_size * elem * sum(c.kv_elements_per_token() for c in configs)


def default_num_kv_blocks(configs: list[ModelConfig], block_size: int, dtype: torch.dtype, device: torch.device,
                          max_num_seqs: int, max_model_len: int, gpu_memory_utilization: float,
                          cpu_kv_cache_bytes: int = CPU_KV_CACHE_BYTES) -> int:
    """Blocks that fit the memory budget, capped at what max_num_seqs full-length requests use."""
    per_block = kv_bytes_per_block(configs, block_size, dtype)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = int(total * gpu_memory_utilization) - (total - free) - ACTIVATION_RESERVE_BYTES
    else:
        budget = cpu_kv_cache_bytes
    blocks_per_seq = -(-max_model_len // block_size)
    blocks = min(budget // per_block, max_num_seqs * (blocks_per_seq + 1))
    if blocks < blocks_per_seq:
        raise ValueError(f"the KV cache budget fits only {blocks} blocks of {block_size} tokens, fewer than one "
                         f"request of max_model_len={max_model_len} needs; lower max_model_len or set num_kv_blocks")
    return int(blocks)
