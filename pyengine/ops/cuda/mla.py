"""CUDA paged MLA attention and latent-cache write (hipkernels/attention/mla_attention.hip,
kv_cache_write.hip). The facade has validated shapes and devices; fp16/bf16 at DeepSeek-V3's
widths (512 + 64) run the attention kernel, anything else the reference."""
from __future__ import annotations

import torch

from pyengine.engine.attention_metadata import AttentionMetadata
from pyengine.ops import reference
from pyengine.ops.cuda.attention import launch_paged_attention
from pyengine.ops.cuda.launch import DTYPE_CODE, kernels, params, row_stride, slots, stream
from pyengine.ops.reference.mla import KV_LORA_RANK, ROPE_DIM


def reshape_and_cache_mla(c_kv: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                          slot_mapping: torch.Tensor) -> None:
    if kv_cache.dtype not in DTYPE_CODE:
        return reference.reshape_and_cache_mla(c_kv, k_pe, kv_cache, slot_mapping)
    num_tokens = c_kv.shape[0]
    slot_ids = slots(slot_mapping)
    if num_tokens == 0:
        return
    c_kv = c_kv.to(kv_cache.dtype)
    k_pe = k_pe.to(kv_cache.dtype)
    if c_kv.stride(-1) != 1:
        c_kv = c_kv.contiguous()
    if k_pe.stride(-1) != 1:
        k_pe = k_pe.contiguous()
    p = params(kernels.ReshapeAndCacheMlaParams, c_kv=c_kv.data_ptr(), k_pe=k_pe.data_ptr(),
               kv_cache=kv_cache.data_ptr(), slot_mapping=slot_ids.data_ptr(), num_tokens=num_tokens,
               kv_lora_rank=c_kv.shape[1], rope_dim=k_pe.shape[1], c_kv_stride_token=row_stride(c_kv),
               k_pe_stride_token=row_stride(k_pe), elem_size=kv_cache.element_size())
    with torch.cuda.device(c_kv.device):
        kernels.reshape_and_cache_mla(p, stream(c_kv.device))


def paged_attention_mla(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                        return_lse: bool = False, kv_lora_rank: int = KV_LORA_RANK
                        ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    if (q.dtype not in (torch.float16, torch.bfloat16) or kv_cache.dtype != q.dtype
            or (kv_lora_rank, kv_cache.shape[2]) != (KV_LORA_RANK, KV_LORA_RANK + ROPE_DIM)):
        return reference.paged_attention_mla(q, kv_cache, meta, scale, return_lse=return_lse, kv_lora_rank=kv_lora_rank)
    return launch_paged_attention(q, kv_cache, kv_cache, meta, scale, return_lse, 1, KV_LORA_RANK, mla=True)
