"""CPU paged MLA attention: absorbed MLA is MQA over one latent head whose value is the first
kv_lora_rank values of the key row, so it runs the C++ GQA kernel (csrc/cpu/cpu_attention.cpp) with
the latent cache as both K and V (one kv head) and keeps the first kv_lora_rank output values.
The rope tail of V costs P / (R + P) extra work (64 / 576 at DeepSeek-V3's widths); in exchange MLA
inherits the kernel's batch invariance and its split of long prefills over the pool."""
from __future__ import annotations

import torch

from pyengine.engine.attention_metadata import AttentionMetadata
from pyengine.ops import reference
from pyengine.ops.cpu.attention import paged_attention, runs_kernel
from pyengine.ops.reference.mla import KV_LORA_RANK


def paged_attention_mla(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                        return_lse: bool = False, kv_lora_rank: int = KV_LORA_RANK
                        ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    if not runs_kernel(q.dtype, kv_cache.dtype, q.shape[2]):
        return reference.paged_attention_mla(q, kv_cache, meta, scale, return_lse=return_lse, kv_lora_rank=kv_lora_rank)
    latent = kv_cache.unsqueeze(2)  # [blocks, block_size, 1, R + P]: one kv head
    result = paged_attention(q, latent, latent, meta, scale, return_lse=return_lse)
    if isinstance(result, tuple):
        return result[0][..., :kv_lora_rank], result[1]
    return result[..., :kv_lora_rank]
