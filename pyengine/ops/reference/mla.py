"""Pure-PyTorch paged MLA ops: the executable spec of the MLA kernels (CPU or GPU, fp32 accumulation).

MLA with weight absorption is MQA over one latent head. The cache holds per token
[c_kv (R = kv_lora_rank, RMS-normed latent) | k_pe (P, after RoPE)], DeepSeek-V3: 512 + 64 = 576
values, layout kv_cache [num_blocks, block_size, R + P], slot = block_id * block_size + offset.
  score[t, h, j] = scale * q[t, h] . K[j]            (q [T, Hq, R + P], K = the cache rows)
  out[t, h]      = softmax_j(score) @ K[j, :R]        (V is the first R values of K)
Query i of a row of q_len tokens attends to keys [0, context_len - (q_len - 1 - i)).
lse[t, h] = logsumexp_j score (natural log, fp32); a query with no keys gets out 0 and lse +inf.
"""
from __future__ import annotations

import torch

from pyengine.engine.attention_metadata import AttentionMetadata

KV_LORA_RANK = 512
ROPE_DIM = 64


def reshape_and_cache_mla(c_kv: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                          slot_mapping: torch.Tensor) -> None:
    """Write [c_kv [T, R] | k_pe [T, P]] of token t into slot slot_mapping[t]; slots < 0 skipped."""
    flat = kv_cache.view(-1, kv_cache.shape[-1])
    valid = slot_mapping >= 0
    rows = torch.cat([c_kv, k_pe], dim=-1).to(kv_cache.dtype)
    flat.index_copy_(0, slot_mapping[valid], rows[valid])


def paged_attention_mla(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                        return_lse: bool = False, kv_lora_rank: int = KV_LORA_RANK
                        ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, R + P] over kv_cache [blocks, block_size, R + P] -> out [T, Hq, R] (+ lse [T, Hq])."""
    num_tokens, num_heads, _ = q.shape
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = torch.zeros(num_tokens, num_heads, kv_lora_rank, dtype=compute, device=q.device)
    lse = torch.full((num_tokens, num_heads), float("inf"), dtype=torch.float32, device=q.device)
    flat = kv_cache.view(-1, kv_cache.shape[-1])
    bs = meta.block_size
    qsl = meta.query_start_loc.tolist()
    ctxs = meta.context_lens.tolist()
    tables = meta.block_tables.to(device=kv_cache.device, dtype=torch.int64)
    for r, ctx in enumerate(ctxs):
        q0, q_len = qsl[r], qsl[r + 1] - qsl[r]
        if q_len == 0 or ctx <= 0:
            continue
        pos = torch.arange(ctx, device=kv_cache.device)
        slots = tables[r, pos // bs] * bs + pos % bs
        k = flat.index_select(0, slots).to(compute)  # [ctx, 576]
        qr = q[q0:q0 + q_len].to(device=kv_cache.device, dtype=compute)  # [q_len, Hq, 576]
        scores = torch.einsum("qhd,kd->qhk", qr, k) * scale
        limit = ctx - (q_len - 1 - torch.arange(q_len, device=kv_cache.device))  # [q_len]
        mask = pos[None, :] < limit[:, None]  # [q_len, ctx]
        scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
        row_lse = torch.logsumexp(scores, dim=-1)  # [q_len, Hq]
        has_keys = mask.any(dim=-1)[:, None]
        probs = torch.where(has_keys[..., None], torch.exp(scores - row_lse[..., None]), torch.zeros_like(scores))
        out[q0:q0 + q_len] = torch.einsum("qhk,kd->qhd", probs, k[:, :kv_lora_rank]).to(out.device)
        lse[q0:q0 + q_len] = torch.where(has_keys, row_lse, torch.full_like(row_lse, float("inf"))).float().to(lse.device)
    out = out.to(q.dtype)
    return (out, lse) if return_lse else out
