"""Test helper: paged KV layout and greedy generation without the C++ core.

Blocks are handed out from a (optionally shuffled) free list so block tables are not contiguous,
and the caches start as NaN so any read outside a row's context poisons the output."""
from __future__ import annotations

import random

import torch

from pyengine.engine.attention_metadata import AttentionMetadata
from pyengine.config import ModelConfig


def make_meta(rows: list[tuple[list[int], int, int]], block_size: int, device: str = "cpu") -> tuple[AttentionMetadata, torch.Tensor]:
    """rows: (block_table, tokens already cached, new tokens this step) -> (meta, positions [T])."""
    slots: list[int] = []
    positions: list[int] = []
    qsl = [0]
    for table, cached, q_len in rows:
        for pos in range(cached, cached + q_len):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
            positions.append(pos)
        qsl.append(qsl[-1] + q_len)
    max_blocks = max([len(t) for t, _, _ in rows] + [1])
    tables = [t + [-1] * (max_blocks - len(t)) for t, _, _ in rows]
    ctx = [cached + q for _, cached, q in rows]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=device).reshape(len(rows), max_blocks),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        context_lens=torch.tensor(ctx, dtype=torch.int32, device=device),
        max_query_len=max([q for _, _, q in rows] + [0]),
        max_context_len=max(ctx + [0]),
        block_size=block_size,
    )
    return meta, torch.tensor(positions, dtype=torch.int64, device=device)


class PagedCache:
    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, seed: int | None = 0) -> None:
        shape = (num_blocks, block_size, config.num_key_value_heads, config.head_dim)
        self.kv_caches = [
            (torch.full(shape, float("nan"), dtype=dtype), torch.full(shape, float("nan"), dtype=dtype))
            for _ in range(config.num_hidden_layers)
        ]
        self.block_size = block_size
        self.free = list(range(num_blocks))
        if seed is not None:
            random.Random(seed).shuffle(self.free)

    def grow(self, table: list[int], length: int) -> None:
        """Append blocks to table until it holds `length` tokens."""
        while len(table) * self.block_size < length:
            table.append(self.free.pop())


@torch.inference_mode()
def greedy_generate(
    model: torch.nn.Module,
    config: ModelConfig,
    prompts: list[list[int]],
    max_new_tokens: int,
    block_size: int = 16,
    prefill_chunk: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Batched greedy decoding (no eos stop). Returns new tokens per prompt and the logits of the
    first generated token per prompt (from the prefill's last position)."""
    total = sum(len(p) for p in prompts) + len(prompts) * max_new_tokens
    cache = PagedCache(config, total // block_size + 2 * len(prompts) + 1, block_size, dtype)
    tables: list[list[int]] = [[] for _ in prompts]
    cached = [0] * len(prompts)
    seqs = [list(p) for p in prompts]
    first_logits: list[torch.Tensor] = [torch.empty(0)] * len(prompts)
    out: list[list[int]] = [[] for _ in prompts]
    while any(len(o) < max_new_tokens for o in out):
        rows, ids, owners = [], [], []
        for i, seq in enumerate(seqs):
            if len(out[i]) >= max_new_tokens:
                continue
            q = len(seq) - cached[i]
            if prefill_chunk is not None:
                q = min(q, prefill_chunk)
            cache.grow(tables[i], cached[i] + q)
            rows.append((tables[i], cached[i], q))
            ids.extend(seq[cached[i] : cached[i] + q])
            owners.append(i)
        meta, positions = make_meta(rows, block_size)
        hidden = model(torch.tensor(ids, dtype=torch.int64), positions, meta, cache.kv_caches)
        last = meta.query_start_loc[1:].long() - 1
        logits = model.compute_logits(hidden[last])
        for row, i in enumerate(owners):
            cached[i] += rows[row][2]
            if cached[i] < len(seqs[i]):
                continue  # mid-prompt chunk: nothing sampled yet
            if not out[i]:
                first_logits[i] = logits[row]
            tok = int(logits[row].argmax())
            out[i].append(tok)
            seqs[i].append(tok)
    return out, first_logits
