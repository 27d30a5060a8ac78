"""CPU paged GQA attention (csrc/cpu/cpu_attention.cpp) for fp32 and bf16 with head_dim a multiple
of 16 up to 768. It reads K/V in place and runs every step, decode, verify and long prefills alike: a row's
queries are cut into chunks of 32 positions per kv head, and those work units are split over the
C++ pool by query-key work, so a long prefill uses every thread with bounded scratch. A query's
output is the same bits whatever shares its step (alone, in a batch, inside a prefill chunk).
Only other dtypes, mixed cache dtypes or other head dims run the reference.
Work is split over the C++ pool only inside an engine step (extension.pool_threads)."""
from __future__ import annotations

import torch

from pyengine.engine.attention_metadata import AttentionMetadata
from pyengine.ops import reference
from pyengine.ops.cpu.extension import DTYPE_CODE, heads_contiguous, kernels, pool_threads, raise_error
from pyengine.ops.kernel_config import get_kernel_config

_META_KEY = "cpu_paged_attention"


def step_tables(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """int32 contiguous block tables, query starts and context lengths, and the step's number of
    query-key pairs; built once per step and shared by every layer."""
    tables = meta.cache.get(_META_KEY)
    if tables is None:
        qsl, ctx, bt = (_int32(t) for t in (meta.query_start_loc, meta.context_lens, meta.block_tables))
        starts, lens = qsl.tolist(), ctx.tolist()  # plain ints: a decode step's torch ops cost more
        pairs = sum((b - a) * c for a, b, c in zip(starts, starts[1:], lens))
        tables = (bt, qsl, ctx, pairs)
        meta.cache[_META_KEY] = tables
    return tables


def _int32(t: torch.Tensor) -> torch.Tensor:
    """t as int32 contiguous; the scheduler's arrays already are (no op called: each costs a few
    microseconds in a decode step whose caches the weights have just flushed)."""
    return t if t.dtype == torch.int32 and t.is_contiguous() else t.to(torch.int32).contiguous()


def runs_kernel(q_dtype: torch.dtype, cache_dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the C++ kernel takes attention of these dtypes and head size (else the reference)."""
    return q_dtype in DTYPE_CODE and cache_dtype == q_dtype and head_dim % 16 == 0 and head_dim <= 768


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, return_lse: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    if (not runs_kernel(q.dtype, k_cache.dtype, q.shape[2]) or v_cache.dtype != q.dtype or q.shape[0] == 0):
        return reference.paged_attention(q, k_cache, v_cache, meta, scale, return_lse=return_lse)
    bt, qsl, ctx, _ = step_tables(meta)
    if not heads_contiguous(q):
        q = q.contiguous()
    num_tokens, num_heads, head_dim = q.shape
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype)
    lse = torch.empty(num_tokens, num_heads, dtype=torch.float32) if return_lse else None
    raise_error(kernels.paged_attention(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
                       0 if lse is None else lse.data_ptr(), bt.data_ptr(), bt.shape[1], qsl.data_ptr(),
                       ctx.data_ptr(), ctx.shape[0], num_heads, k_cache.shape[2], head_dim, k_cache.shape[1],
                       k_cache.shape[0], scale, DTYPE_CODE[q.dtype], pool_threads(),
                       get_kernel_config().cpu_avx2_kernels))
    return (out, lse) if lse is not None else out
