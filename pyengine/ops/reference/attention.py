"""Pure-PyTorch paged GQA attention and KV-cache write: the executable spec of the GPU kernels and
the CPU fast path (validation lives in the pyengine.ops facade).

Layouts (vLLM vocabulary):
  k_cache / v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
  slot = block_id * block_size + offset; slot_mapping[t] == -1 means "do not write token t".

paged_attention pads the step's rows to a dense [rows, max_query_len] x [rows, max_context_len]
problem. The gather indices and the mask depend only on the metadata, so they are built once per
step and memoised in meta.cache: every layer of the model then pays for two index_selects and one
fused attention call, never a Python loop over rows. paged_attention_per_query is the exception: a
loop over query tokens whose every shape depends on the token alone (the batch-invariant fallback).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pyengine.engine.attention_metadata import AttentionMetadata

_CACHE_KEY = "reference_paged_attention"


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """Write key/value [T, Hkv, D] of token t into slot slot_mapping[t]; slots < 0 are skipped.
    The KV write of rope_and_cache (layer.py), which is the op the models call."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    valid = slot_mapping >= 0
    if bool(valid.all()):
        k_flat.index_copy_(0, slot_mapping, key.to(k_cache.dtype))
        v_flat.index_copy_(0, slot_mapping, value.to(v_cache.dtype))
        return
    slots = slot_mapping[valid]
    k_flat.index_copy_(0, slots, key[valid].to(k_cache.dtype))
    v_flat.index_copy_(0, slots, value[valid].to(v_cache.dtype))


@dataclass
class _StepPlan:
    """Per-step derived tensors shared by every layer (see module docstring)."""

    kv_slots: torch.Tensor  # [R, Lk] int64 cache slot per (row, key position), see _build_plan
    q_index: torch.Tensor | None  # [R * Lq] int64 token index per (row, query position); None = identity
    out_index: torch.Tensor | None  # [T] int64 position of token t in the flat [R * Lq] padded layout
    mask: torch.Tensor  # [R, 1, Lq, Lk] bool, True = attend
    num_rows: int
    q_pad: int  # Lq
    kv_pad: int  # Lk
    plain_causal: bool  # every row is a fresh prompt of length Lq == Lk (top-left causal mask)
    biases: dict[tuple[int, torch.dtype], torch.Tensor]  # (group, dtype) -> additive mask [R, 1, G*Lq, Lk]
    kv_indices: dict[int, torch.Tensor]  # num_kv_heads -> [R * Hkv * Lk] rows of cache.view(-1, D)

    def kv_index(self, num_kv_heads: int) -> torch.Tensor:
        """Gather rows of the cache seen as [slots * Hkv, D], ordered [R, Hkv, Lk]: the gathered
        K/V come out directly in the layout attention needs, without a transpose copy."""
        index = self.kv_indices.get(num_kv_heads)
        if index is None:
            heads = torch.arange(num_kv_heads, device=self.kv_slots.device)
            index = (self.kv_slots[:, None, :] * num_kv_heads + heads[None, :, None]).reshape(-1)
            self.kv_indices[num_kv_heads] = index
        return index

    def bias(self, group: int, dtype: torch.dtype) -> torch.Tensor:
        """Additive 0/-inf mask with the GQA group folded into the query axis. Float masks take
        the fast fused CPU kernels where boolean ones are much slower."""
        key = (group, dtype)
        bias = self.biases.get(key)
        if bias is None:
            mask = self.mask if group == 1 else self.mask.repeat(1, 1, group, 1)
            bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
            self.biases[key] = bias
        return bias


def _build_plan(meta: AttentionMetadata, device: torch.device) -> _StepPlan:
    block_size = meta.block_size
    rows = meta.num_rows
    qsl = meta.query_start_loc.to(device=device, dtype=torch.int64)
    q_lens = qsl[1:] - qsl[:-1]
    ctx = meta.context_lens.to(device=device, dtype=torch.int64)
    lq = max(int(meta.max_query_len), 1)
    lk = max(int(meta.max_context_len), 1)

    # Key side: slot of every (row, key position) from the block table. Positions past the
    # context re-read the row's own position 0 (written, so finite): the -inf mask then gives
    # them weight exactly 0, whereas reading an unused page could bring NaN (and NaN * 0 = NaN).
    pos_k = torch.arange(lk, device=device)
    kv_valid = pos_k[None, :] < ctx[:, None]  # [R, Lk]
    block_tables = meta.block_tables.to(device=device, dtype=torch.int64)
    block_idx = (pos_k // block_size).clamp(max=max(block_tables.shape[1] - 1, 0))
    if block_tables.shape[1] == 0:
        blocks = torch.zeros(rows, lk, dtype=torch.int64, device=device)
    else:
        blocks = block_tables[:, block_idx]  # [R, Lk]
    slots = blocks * block_size + (pos_k % block_size)[None, :]
    slots = torch.where(kv_valid, slots, slots[:, :1])
    # Rows with an empty context (no tokens this step either) have no slot of their own; any
    # in-range slot will do since no output of theirs is kept.
    slots = slots.clamp(min=0)

    # Query side: query i of row r sits at padded position (r, i). A pure-decode batch
    # (every row has exactly one query) is already in that layout, so no gather is needed.
    pos_q = torch.arange(lq, device=device)
    q_valid = pos_q[None, :] < q_lens[:, None]  # [R, Lq]
    identity = lq == 1 and rows == meta.num_tokens and bool(q_valid.all())
    if identity:
        q_index = out_index = None
    else:
        q_index = torch.where(q_valid, qsl[:-1, None] + pos_q[None, :], torch.zeros_like(pos_q)[None, :])
        q_index = q_index.reshape(-1)
        row_of_tok = torch.repeat_interleave(torch.arange(rows, device=device), q_lens)
        tok = torch.arange(int(qsl[-1]), device=device)
        out_index = row_of_tok * lq + (tok - qsl[:-1][row_of_tok])

    # Causal limit: query i of a row of q_len tokens sees keys [0, ctx - (q_len - 1 - i)).
    limit = ctx[:, None] - (q_lens[:, None] - 1 - pos_q[None, :])  # [R, Lq]
    mask = pos_k[None, None, :] < limit[:, :, None]  # [R, Lq, Lk]
    # Padded queries and empty contexts would be fully masked; let them see key 0 so the
    # softmax is well defined. Their outputs are discarded.
    empty = ~mask.any(dim=-1, keepdim=True)
    mask = mask | (empty & (pos_k == 0)[None, None, :])
    return _StepPlan(
        kv_slots=slots,
        q_index=q_index,
        out_index=out_index,
        mask=mask[:, None],
        num_rows=rows,
        q_pad=lq,
        kv_pad=lk,
        plain_causal=lq == lk and bool((q_lens == lq).all()) and bool((ctx == lq).all()),
        biases={},
        kv_indices={},
    )


def _plan(meta: AttentionMetadata, device: torch.device) -> _StepPlan:
    plan = meta.cache.get(_CACHE_KEY)
    if plan is None:
        plan = _build_plan(meta, device)
        meta.cache[_CACHE_KEY] = plan
    return plan


def _gather_kv(cache: torch.Tensor, plan: _StepPlan, dtype: torch.dtype) -> torch.Tensor:
    """[R, Hkv, Lk, D] of the rows' contexts (padding positions hold finite, masked-out values)."""
    num_kv_heads, head_dim = cache.shape[2], cache.shape[3]
    kv = cache.view(-1, head_dim).index_select(0, plan.kv_index(num_kv_heads))
    return kv.view(plan.num_rows, num_kv_heads, plan.kv_pad, head_dim).to(dtype)


_SPLIT_KEY = "reference_paged_attention_split"
_SMALL_QUERY = 16  # rows padded to at most this many queries take the explicit matmul path
# A mixed decode + verify step runs as one decode batch with a row per query while the extra rows
# times the longest context stay under this many keys: re-gathering a row's K/V for each extra
# query beats a second attention call per layer up to about 8 extra queries at contexts of ~250
# (2 CPU threads, SmolLM2 shapes: 1.5-3.5 ms a step faster at batch 8-32; 16 extra: 1-3 ms slower).
_UNROLL_BUDGET = 2048


def _one_row_per_query(meta: AttentionMetadata, q_lens: torch.Tensor) -> AttentionMetadata:
    """The same attention with every query as a row of its own (query i of a row of q_len tokens
    sees the first ctx - (q_len - 1 - i) keys): a pure decode batch, rows in token order."""
    rows = meta.num_rows
    row_of_tok = torch.repeat_interleave(torch.arange(rows, device=q_lens.device), q_lens)
    tok = torch.arange(meta.num_tokens, device=q_lens.device)
    qsl = meta.query_start_loc.to(torch.int64)
    after = qsl[1:][row_of_tok] - 1 - tok  # queries of the same row after this one
    ctx = meta.context_lens.to(torch.int64)[row_of_tok] - after
    return AttentionMetadata(
        slot_mapping=meta.slot_mapping,
        block_tables=meta.block_tables[row_of_tok],
        query_start_loc=torch.arange(meta.num_tokens + 1, device=q_lens.device).to(meta.query_start_loc.dtype),
        context_lens=ctx.to(meta.context_lens.dtype),
        max_query_len=1,
        max_context_len=int(meta.max_context_len),
        block_size=meta.block_size,
    )


def _split_by_query_length(meta: AttentionMetadata) -> list[tuple[torch.Tensor | None, AttentionMetadata]] | None:
    """Sub-batches to run instead of the dense padded layout, or None for a uniform batch.

    The dense layout pads every row to the longest query: one verify row of 1 + k tokens (or a
    prefill chunk) would make every decode row in the step pay for 1 + k queries. Decode rows
    mixed with a few short verify rows become one decode batch with a row per query (token
    order: no gather or scatter of q and out; each extra row re-reads its context); otherwise
    single-query rows and the other rows run as two sub-batches. Built once per step and shared
    by every layer, like the plan."""
    parts = meta.cache.get(_SPLIT_KEY, False)
    if parts is not False:
        return parts
    qsl = meta.query_start_loc.to(torch.int64)
    q_lens = qsl[1:] - qsl[:-1]
    single = q_lens == 1
    parts = None
    extra_rows = meta.num_tokens - meta.num_rows
    if (bool(single.any()) and not bool(single.all()) and int(meta.max_query_len) <= _SMALL_QUERY
            and extra_rows * int(meta.max_context_len) <= _UNROLL_BUDGET):
        parts = [(None, _one_row_per_query(meta, q_lens))]
    elif bool(single.any()) and not bool(single.all()):
        parts = []
        for rows in (torch.nonzero(single).flatten(), torch.nonzero(~single).flatten()):
            lens = q_lens[rows]
            row_of_tok = torch.repeat_interleave(torch.arange(len(rows), device=rows.device), lens)
            starts = torch.cumsum(lens, 0) - lens
            tokens = qsl[rows][row_of_tok] + torch.arange(int(lens.sum()), device=rows.device) - starts[row_of_tok]
            ctx = meta.context_lens[rows]
            sub = AttentionMetadata(
                slot_mapping=meta.slot_mapping[tokens],
                block_tables=meta.block_tables[rows],
                query_start_loc=torch.cat([lens.new_zeros(1), torch.cumsum(lens, 0)]).to(meta.query_start_loc.dtype),
                context_lens=ctx,
                max_query_len=int(lens.max()),
                max_context_len=int(ctx.max()),
                block_size=meta.block_size,
            )
            parts.append((tokens, sub))
    meta.cache[_SPLIT_KEY] = parts
    return parts


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                    return_lse: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Varlen causal GQA attention of q [T, Hq, D] over the paged cache -> out [T, Hq, D]
    (and lse [T, Hq] float32, natural log, when return_lse)."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    # fp32 accumulation for half types; float64 stays float64 (the tests' exact oracle).
    compute_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    if num_tokens == 0:
        out = q.new_zeros(q.shape)
        lse = torch.zeros(0, num_heads, dtype=torch.float32, device=q.device)
        return (out, lse) if return_lse else out
    parts = _split_by_query_length(meta)
    if parts is not None and parts[0][0] is None:  # one row per query, in token order
        return paged_attention(q, k_cache, v_cache, parts[0][1], scale, return_lse)
    if parts is not None:
        out = q.new_empty(q.shape)
        lse = torch.empty(num_tokens, num_heads, dtype=torch.float32, device=q.device)
        for tokens, sub in parts:
            res = paged_attention(q.index_select(0, tokens), k_cache, v_cache, sub, scale, return_lse)
            if return_lse:
                out[tokens], lse[tokens] = res
            else:
                out[tokens] = res
        return (out, lse) if return_lse else out
    plan = _plan(meta, q.device)
    rows, lq = plan.num_rows, plan.q_pad

    qc = q.to(compute_dtype)
    qp = qc if plan.q_index is None else qc.index_select(0, plan.q_index)
    # [R, Hq, Lq, D] is, in memory, [R, Hkv, G * Lq, D] (head h = kv_head * G + g): both the
    # explicit path (GQA group folded into the query axis, K/V never repeated) and SDPA's
    # enable_gqa path produce that layout, which unpad() maps back to tokens.
    qp = qp.view(rows, lq, num_heads, head_dim).transpose(1, 2)
    k = _gather_kv(k_cache, plan, compute_dtype)
    v = _gather_kv(v_cache, plan, compute_dtype)

    lse_p = None
    if return_lse or lq <= _SMALL_QUERY:
        # Decode and verify (1 + k queries): scores are small ([G * Lq, Lk] per kv head), plain
        # matmuls beat SDPA's dispatch (about 30% per call on CPU for 1 + 4 queries).
        qf = qp.reshape(rows, num_kv_heads, group * lq, head_dim)
        scores = torch.matmul(qf, k.transpose(-1, -2)).mul_(scale).add_(plan.bias(group, compute_dtype))
        if return_lse:
            lse_p = torch.logsumexp(scores, dim=-1)  # [R, Hkv, G*Lq]
        out_p = torch.matmul(torch.softmax(scores, dim=-1), v)
    elif plan.plain_causal:
        # Fresh equal-length prompts: the standard causal mask, SDPA's flash kernel, no bias.
        out_p = F.scaled_dot_product_attention(qp, k, v, is_causal=True, scale=scale, enable_gqa=group > 1)
    else:
        # Prefill/mixed: bias [R, 1, Lq, Lk] shared by all heads (not repeated per group).
        bias = plan.bias(1, compute_dtype)
        out_p = F.scaled_dot_product_attention(qp, k, v, attn_mask=bias, scale=scale, enable_gqa=group > 1)

    def unpad(x: torch.Tensor) -> torch.Tensor:
        # [R, Hkv, G*Lq, ...] -> [T, Hq, ...]
        tail = x.shape[3:]
        x = x.reshape(rows, num_kv_heads, group, lq, *tail).movedim(3, 1)
        x = x.reshape(rows * lq, num_heads, *tail)
        return x if plan.out_index is None else x.index_select(0, plan.out_index)

    out = unpad(out_p).to(q.dtype)
    if not return_lse:
        return out
    assert lse_p is not None
    return out, unpad(lse_p[..., None])[..., 0].to(torch.float32)


def paged_attention_per_query(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                              scale: float, return_lse: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """paged_attention with every query token computed on its own: the batch-invariant fallback
    for a backend whose kernels do not take a dtype or head size (CUDA fp32) under
    KernelConfig.batch_invariant. paged_attention pads the step's rows to one dense problem, so a
    token's sums there change with the other rows and with its own row's query length. Here token
    i of a row of q_len gathers exactly the keys it sees (the first ctx - (q_len - 1 - i)) and runs
    one product, one softmax and one product whose shapes are a function of that key count and the
    heads alone: the same kernels, so the same bits, whether it is decoded alone, verified beside
    drafts or prefilled in any chunk of any batch. A Python loop over tokens with host reads of the
    metadata: slow, and eager steps only. A token with no keys: out 0, lse +inf."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    compute_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = q.new_zeros(q.shape)
    lse = torch.full((num_tokens, num_heads), float("inf"), dtype=torch.float32, device=q.device)
    k_rows = k_cache.view(-1, num_kv_heads, head_dim)  # [slots, Hkv, D]
    v_rows = v_cache.view(-1, num_kv_heads, head_dim)
    qsl, ctx = meta.query_start_loc.tolist(), meta.context_lens.tolist()
    tables = meta.block_tables.to(device=q.device, dtype=torch.int64)
    for r in range(meta.num_rows):
        q_len, num_keys = int(qsl[r + 1]) - int(qsl[r]), int(ctx[r])
        if q_len <= 0 or num_keys <= 0:
            continue
        pos = torch.arange(num_keys, device=q.device)
        slots = tables[r, pos // meta.block_size] * meta.block_size + pos % meta.block_size
        for i in range(q_len):
            keys = num_keys - (q_len - 1 - i)
            if keys <= 0:
                continue
            t = int(qsl[r]) + i
            # fresh contiguous operands: each product's layout and alignment depend on `keys` alone
            k = k_rows.index_select(0, slots[:keys]).to(compute_dtype).transpose(0, 1).contiguous()  # [Hkv, L, D]
            v = v_rows.index_select(0, slots[:keys]).to(compute_dtype).transpose(0, 1).contiguous()
            qt = q[t].to(compute_dtype).reshape(num_kv_heads, group, head_dim).clone()
            scores = torch.matmul(qt, k.transpose(1, 2)) * scale  # [Hkv, G, L]
            out[t] = torch.matmul(torch.softmax(scores, dim=-1), v).reshape(num_heads, head_dim).to(q.dtype)
            if return_lse:
                lse[t] = torch.logsumexp(scores, dim=-1).reshape(num_heads).to(torch.float32)
    return (out, lse) if return_lse else out
