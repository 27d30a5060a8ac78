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

import math
from collections.abc import Iterator

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


def _rows(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, compute: torch.dtype
          ) -> Iterator[tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per row with queries and keys: (first token, query length, its queries [q_len, Hq, R + P] and
    keys [ctx, R + P] in `compute`, the causal mask [q_len, ctx]: query i sees keys < ctx - q_len + 1 + i)."""
    flat = kv_cache.view(-1, kv_cache.shape[-1])
    bs = meta.block_size
    qsl = meta.query_start_loc.tolist()
    tables = meta.block_tables.to(device=kv_cache.device, dtype=torch.int64)
    for r, ctx in enumerate(meta.context_lens.tolist()):
        q0, q_len = qsl[r], qsl[r + 1] - qsl[r]
        if q_len == 0 or ctx <= 0:
            continue
        pos = torch.arange(ctx, device=kv_cache.device)
        k = flat.index_select(0, tables[r, pos // bs] * bs + pos % bs).to(compute)
        qr = q[q0:q0 + q_len].to(device=kv_cache.device, dtype=compute)
        limit = ctx - (q_len - 1 - torch.arange(q_len, device=kv_cache.device))
        yield q0, q_len, qr, k, pos[None, :] < limit[:, None]


def paged_attention_mla(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                        return_lse: bool = False, kv_lora_rank: int = KV_LORA_RANK
                        ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, R + P] over kv_cache [blocks, block_size, R + P] -> out [T, Hq, R] (+ lse [T, Hq])."""
    num_tokens, num_heads, _ = q.shape
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = torch.zeros(num_tokens, num_heads, kv_lora_rank, dtype=compute, device=q.device)
    lse = torch.full((num_tokens, num_heads), float("inf"), dtype=torch.float32, device=q.device)
    for q0, q_len, qr, k, mask in _rows(q, kv_cache, meta, compute):
        scores = torch.einsum("qhd,kd->qhk", qr, k) * scale
        scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
        row_lse = torch.logsumexp(scores, dim=-1)  # [q_len, Hq]
        has_keys = mask.any(dim=-1)[:, None]
        probs = torch.where(has_keys[..., None], torch.exp(scores - row_lse[..., None]), torch.zeros_like(scores))
        out[q0:q0 + q_len] = torch.einsum("qhk,kd->qhd", probs, k[:, :kv_lora_rank]).to(out.device)
        lse[q0:q0 + q_len] = torch.where(has_keys, row_lse, torch.full_like(row_lse, float("inf"))).float().to(lse.device)
    out = out.to(q.dtype)
    return (out, lse) if return_lse else out


MERGE_SLACK = 8.0  # base-2 units: hipkernels/attention/attention_common.h kMergeSlack


def paged_attention_mla_ranges(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                               return_lse: bool = False, kv_lora_rank: int = KV_LORA_RANK, range_size: int = 512
                               ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The kernels' formulation of paged_attention_mla (hipkernels/attention/mla_ranges.h): a query's
    keys are summed in ranges [r U, (r + 1) U), U = range_size, each a normalised partial (values
    o_r / L_r, base-2 lse_r = M_r + log2 L_r; -inf without keys), merged in range order from the
    empty state (m = -inf, l = 0, o = 0) as merge_range does, the reference m moving only when a
    range's lse passes it by more than MERGE_SLACK (always from the empty state):
        lse_r > m + 8:  a = 2^(m - lse_r);  l = l a + 1;  o = o a + po_r;  m = lse_r
        otherwise:      b = 2^(lse_r - m);  l = l + b;    o = o + b po_r
    (a range without keys skipped; the kernels' add flushes subnormals, as the L2's red.add does),
    out = o / l, lse = (m + log2 l) ln 2 (+inf, out 0 without keys).
    Equal to paged_attention_mla up to rounding; a query's arithmetic depends only on its own keys."""
    num_tokens, num_heads, _ = q.shape
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = torch.zeros(num_tokens, num_heads, kv_lora_rank, dtype=compute, device=q.device)
    lse = torch.full((num_tokens, num_heads), float("inf"), dtype=torch.float32, device=q.device)
    log2e = 1.4426950408889634
    for q0, q_len, qr, k, mask in _rows(q, kv_cache, meta, compute):
        ctx = k.shape[0]
        s2 = torch.einsum("qhd,kd->qhk", qr, k) * (scale * log2e)  # base-2 scores
        s2 = s2.masked_fill(~mask[:, None, :], float("-inf"))
        m = torch.full((q_len, num_heads), float("-inf"), dtype=compute, device=kv_cache.device)
        l_sum = torch.zeros_like(m)
        o = torch.zeros(q_len, num_heads, kv_lora_rank, dtype=compute, device=kv_cache.device)
        for k0 in range(0, ctx, range_size):
            sr = s2[:, :, k0:k0 + range_size]
            mr = sr.amax(dim=-1)
            has = mr > float("-inf")
            p = torch.exp2(sr - torch.where(has, mr, torch.zeros_like(mr))[..., None])
            lr = p.sum(dim=-1)
            po = torch.einsum("qhk,kd->qhd", p, k[k0:k0 + range_size, :kv_lora_rank]) / torch.where(
                has, lr, torch.ones_like(lr))[..., None]
            lse_r = torch.where(has, mr + torch.log2(lr), torch.full_like(mr, float("-inf")))
            moves = has & (lse_r > m + MERGE_SLACK)
            mn = torch.where(moves, lse_r, m)
            a = torch.where(moves, torch.exp2(m - mn), torch.ones_like(m))
            b = torch.where(has, torch.exp2(lse_r - mn), torch.zeros_like(m))
            l_sum = l_sum * a + b
            o = o * a[..., None] + b[..., None] * po
            m = mn
        has_keys = l_sum > 0
        out[q0:q0 + q_len] = (o / torch.where(has_keys, l_sum, torch.ones_like(l_sum))[..., None]).to(out.device)
        lse[q0:q0 + q_len] = torch.where(has_keys, (m + torch.log2(l_sum)) * math.log(2.0),
                                         torch.full_like(m, float("inf"))).float().to(lse.device)
    out = out.to(q.dtype)
    return (out, lse) if return_lse else out
