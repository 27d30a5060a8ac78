"""How many KV blocks and recurrent-state slots the pools get: the one place that turns a memory
budget into blocks and slots."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pyengine.config import ModelConfig

CPU_KV_CACHE_BYTES = 2 << 30  # default CPU budget; LLM(cpu_kv_cache_bytes=...) overrides it
ACTIVATION_RESERVE_BYTES = 1 << 30  # GPU memory left for activations and workspaces
STATE_CHECKPOINT_SHARE = 0.1  # of the cache budget, for a hybrid model's state checkpoints by default
MAX_STATE_CHECKPOINTS_PER_SEQ = 4  # default cap: checkpoints per max_num_seqs
# Default tokens between state checkpoints: prefill chunks end at every checkpoint position, so a
# checkpoint every 16-token block would cut prompts into 16-token steps.
DEFAULT_STATE_CHECKPOINT_INTERVAL = 256


def kv_bytes_per_block(configs: list[ModelConfig], block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block costs in every cache that shares the block pool (the target's, and a draft
    model's, which writes the same slots)."""
    elem = torch.tensor([], dtype=dtype).element_size()
    return block_size * elem * sum(c.kv_elements_per_token() for c in configs)


def cache_budget_bytes(device: torch.device, gpu_memory_utilization: float,
                       cpu_kv_cache_bytes: int = CPU_KV_CACHE_BYTES) -> int:
    """Memory for the caches (KV blocks and recurrent state): on CUDA the share of the device's
    memory not yet used, less the activation reserve; on the CPU cpu_kv_cache_bytes."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return int(total * gpu_memory_utilization) - (total - free) - ACTIVATION_RESERVE_BYTES
    return cpu_kv_cache_bytes


@dataclass
class StatePoolPlan:
    """A hybrid model's recurrent-state pool: 1 + k running slots per request, then checkpoints."""
    num_slots: int
    num_checkpoints: int
    checkpoint_interval: int  # tokens; 0 without checkpoints
    bytes_per_slot: int

    @property
    def num_bytes(self) -> int:
        return (self.num_slots + self.num_checkpoints) * self.bytes_per_slot


def plan_state_pool(state_shapes: list, dtype: torch.dtype, num_spec_tokens: int, max_num_seqs: int,
                    block_size: int, prefix_caching: bool, budget_bytes: int, num_checkpoints: int | None,
                    checkpoint_interval: int | None) -> StatePoolPlan:
    """state_shapes: the model's per-layer (conv row shape, ssm shape) or None. Checkpoints exist only
    with prefix caching: by default STATE_CHECKPOINT_SHARE of the budget, at most
    MAX_STATE_CHECKPOINTS_PER_SEQ per max_num_seqs, every DEFAULT_STATE_CHECKPOINT_INTERVAL tokens
    (rounded up to whole blocks)."""
    elem = torch.tensor([], dtype=dtype).element_size()
    per_slot = sum(torch.Size(conv).numel() * elem + torch.Size(ssm).numel() * 4
                   for conv, ssm in (s for s in state_shapes if s is not None))
    if checkpoint_interval is not None and (checkpoint_interval <= 0 or checkpoint_interval % block_size):
        raise ValueError(f"state_checkpoint_interval must be a positive multiple of block_size ({block_size}), "
                         f"got {checkpoint_interval}")
    if not prefix_caching:
        return StatePoolPlan(max_num_seqs * (1 + num_spec_tokens), 0, 0, per_slot)
    if num_checkpoints is None:
        num_checkpoints = min(MAX_STATE_CHECKPOINTS_PER_SEQ * max_num_seqs,
                              int(budget_bytes * STATE_CHECKPOINT_SHARE) // max(per_slot, 1))
    interval = checkpoint_interval or -(-DEFAULT_STATE_CHECKPOINT_INTERVAL // block_size) * block_size
    return StatePoolPlan(max_num_seqs * (1 + num_spec_tokens), num_checkpoints, interval, per_slot)


def default_num_kv_blocks(configs: list[ModelConfig], block_size: int, dtype: torch.dtype, device: torch.device,
                          max_num_seqs: int, max_model_len: int, gpu_memory_utilization: float,
                          cpu_kv_cache_bytes: int = CPU_KV_CACHE_BYTES, reserved_bytes: int = 0) -> int:
    """Blocks that fit the memory budget less reserved_bytes (a recurrent-state pool), capped at what
    max_num_seqs full-length requests use."""
    per_block = kv_bytes_per_block(configs, block_size, dtype)
    budget = cache_budget_bytes(device, gpu_memory_utilization, cpu_kv_cache_bytes) - reserved_bytes
    blocks_per_seq = -(-max_model_len // block_size)
    blocks = min(budget // per_block, max_num_seqs * (blocks_per_seq + 1))
    if blocks < blocks_per_seq:
        raise ValueError(f"the KV cache budget fits only {blocks} blocks of {block_size} tokens, fewer than one "
                         f"request of max_model_len={max_model_len} needs; lower max_model_len or set num_kv_blocks")
    return int(blocks)
