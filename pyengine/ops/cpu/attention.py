"""CPU paged GQA attention (csrc/cpu/cpu_attention.cpp) for fp32 and bf16 with head_dim a multiple
of 16: it reads K/V in place, which wins for decode and verify steps (a few queries per row); a step
with much more attention work than that (long prefills) runs the reference, whose SDPA kernel uses
every core. Rows are split over the C++ pool only inside an engine step (extension.pool_threads)."""
from __future__ import annotations

import torch

from pyengine.engine.attention_metadata import AttentionMetadata
from pyengine.ops import reference
from pyengine.ops.cpu.extension import DTYPE_CODE, heads_contiguous, kernels, pool_threads, raise_error

_META_KEY = "cpu_paged_attention"
# Query-key pairs (summed over rows) above which a step's attention runs the reference instead:
# beyond this the multi-threaded SDPA kernel beats one thread (measured on SmolLM2 shapes).
MAX_QUERY_KEY_PAIRS = 1 << 15


def step_tables(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """int32 contiguous block tables, query starts and context lengths, and the step's number of
    query-key pairs; built once per step and shared by every layer."""
    tables = meta.cache.get(_META_KEY)
    if tables is None:
        qsl = meta.query_start_loc.to(torch.int32).contiguous()
        ctx = meta.context_lens.to(torch.int32).contiguous()
        bt = meta.block_tables.to(torch.int32).contiguous()
        pairs = int(((qsl[1:] - qsl[:-1]).to(torch.int64) * ctx.to(torch.int64)).sum())
        tables = (bt, qsl, ctx, pairs)
        meta.cache[_META_KEY] = tables
    return tables


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, return_lse: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    code = DTYPE_CODE.get(q.dtype)
    bt, qsl, ctx, pairs = step_tables(meta)
    if (code is None or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype or pairs > MAX_QUERY_KEY_PAIRS
            or q.shape[0] == 0 or q.shape[2] % 16):
        return reference.paged_attention(q, k_cache, v_cache, meta, scale, return_lse=return_lse)
    if not heads_contiguous(q):
        q = q.contiguous()
    num_tokens, num_heads, head_dim = q.shape
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype)
    lse = torch.empty(num_tokens, num_heads, dtype=torch.float32) if return_lse else None
    raise_error(kernels.paged_attention(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
                       0 if lse is None else lse.data_ptr(), bt.data_ptr(), bt.shape[1], qsl.data_ptr(),
                       ctx.data_ptr(), ctx.shape[0], num_heads, k_cache.shape[2], head_dim, k_cache.shape[1],
                       k_cache.shape[0], scale, code, pool_threads()))
    return (out, lse) if lse is not None else out
