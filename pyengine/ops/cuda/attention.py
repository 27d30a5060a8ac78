"""CUDA paged GQA attention (hipkernels/attention/): fills PagedAttentionParams for the kernels.

The facade (pyengine.ops) has validated shapes and devices. Here: fp16/bf16 queries and caches with
head_dim 64, 128 or 256 run the kernels, anything else the reference; the per-step int32 metadata
and the split-KV workspace are built once per step (meta.cache) and shared by every layer, and
meta.max_query_len / meta.max_context_len must be upper bounds of the rows' values. The kernel
variant (tensor-core or FMA GQA kernel, pairs per block, PDL) comes from the current KernelConfig.

Under KernelConfig.batch_invariant the GQA kernels use the fixed split rule (params.fixed_splits,
hipkernels/attention/paged_attention.h): a query's keys are summed in ranges of SPLIT_BLOCK keys at
fixed boundaries, each from a fresh state, merged in range order by one sequential merge; decode
and verify rows put each range in the workspace (ceil(max_context_len / SPLIT_BLOCK) splits, no
MAX_SPLITS cap) and the combine merges them, longer rows walk their ranges in the block. A query's
bits then depend only on its own keys. (MLA: pyengine/ops/cuda/mla.py, the same ranges.) What the
kernels do not take (fp32,
other head sizes) runs the reference: in this mode its per-query form
(reference.attention.paged_attention_per_query, slow, eager only), since the padded one sums a
token's keys in a layout that changes with the step.
"""
from __future__ import annotations

import math

import torch

from pyengine.engine.attention_metadata import AttentionMetadata
from pyengine.ops import reference
from pyengine.ops.cuda.launch import DTYPE_CODE, aligned_rows, kernels, num_sms, params, row_stride, stream
from pyengine.ops.kernel_config import get_kernel_config
from pyengine.ops.reference.attention import paged_attention_per_query

_CONST = kernels.paged_attention_constants()
SPLIT_BLOCK: int = _CONST["split_block"]  # keys per split unit; process-wide (benchmarks sweep it)
MAX_SPLITS: int = _CONST["max_splits"]
SPLIT_MAX_QUERY_LEN: int = _CONST["split_max_query_len"]
_ATTENTION_DTYPES = (torch.float16, torch.bfloat16)
_PLAN_KEY = "cuda_paged_attention"


def max_splits_for(max_context_len: int, fixed: bool = False) -> int:
    """Workspace split dimension for a step (the kernel's per-row rule never exceeds it); fixed: the
    batch-invariant rule (one split per SPLIT_BLOCK keys, uncapped)."""
    splits = math.ceil(max(max_context_len, 0) / SPLIT_BLOCK)
    return max(1, splits if fixed else min(MAX_SPLITS, splits))


def plan(meta: AttentionMetadata, device: torch.device) -> dict:
    """int32 metadata on the device and each split row's first workspace token (memoised per step)."""
    step = meta.cache.get(_PLAN_KEY)
    if step is None:
        qsl = meta.query_start_loc.to(device=device, dtype=torch.int32).contiguous()
        q_lens = qsl[1:] - qsl[:-1]
        split_tokens = torch.where(q_lens <= SPLIT_MAX_QUERY_LEN, q_lens, torch.zeros_like(q_lens))
        ws_start = (torch.cumsum(split_tokens, 0, dtype=torch.int32) - split_tokens).contiguous()
        step = {
            "qsl": qsl,
            "ctx": meta.context_lens.to(device=device, dtype=torch.int32).contiguous(),
            "tables": meta.block_tables.to(device=device, dtype=torch.int32).contiguous(),
            "ws_start": ws_start,
            "ws_tokens": min(meta.num_tokens, meta.num_rows * SPLIT_MAX_QUERY_LEN),
            "max_splits": max_splits_for(meta.max_context_len),
            "max_splits_fixed": max_splits_for(meta.max_context_len, fixed=True),
            "workspace": {},
        }
        meta.cache[_PLAN_KEY] = step
    return step


def new_outputs(q: torch.Tensor, head_dim_v: int, return_lse: bool, meta: AttentionMetadata
                ) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
    """(out [T, Hq, head_dim_v], lse [T, Hq] or None, whether a kernel has work): a step without
    tokens or rows gets zeros and lse +inf (no keys) here."""
    num_tokens, num_heads = q.shape[:2]
    out = torch.empty(num_tokens, num_heads, head_dim_v, dtype=q.dtype, device=q.device)
    lse = torch.empty(num_tokens, num_heads, dtype=torch.float32, device=q.device) if return_lse else None
    if num_tokens and meta.num_rows:
        return out, lse, True
    out.zero_()
    if lse is not None:
        lse.fill_(float("inf"))
    return out, lse, False


def split_workspace(step: dict, key: tuple, num_heads: int, head_dim_v: int, max_splits: int,
                    device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's fp32 split-KV partials (values, lse) for max_splits splits, made once per key."""
    ws = step["workspace"].get(key)
    if ws is None:
        n = step["ws_tokens"] * num_heads * max_splits if max_splits > 1 else 0
        ws = (torch.empty(max(n * head_dim_v, 1), dtype=torch.float32, device=device),
              torch.empty(max(n, 1), dtype=torch.float32, device=device))
        step["workspace"][key] = ws
    return ws


def launch_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                           scale: float, return_lse: bool, num_kv_heads: int, head_dim_v: int):
    """out [T, Hq, head_dim_v] (and lse) of the GQA kernels."""
    num_heads, head_dim = q.shape[1:]
    out, lse, work = new_outputs(q, head_dim_v, return_lse, meta)
    if not work:
        return (out, lse) if return_lse else out
    step = plan(meta, q.device)
    config = get_kernel_config()
    fixed = bool(config.batch_invariant)
    max_splits = step["max_splits_fixed"] if fixed else step["max_splits"]
    ws = split_workspace(step, (num_heads, head_dim_v, max_splits), num_heads, head_dim_v, max_splits, q.device)
    q = aligned_rows(q)
    tables = step["tables"]
    p = params(
        kernels.PagedAttentionParams, q=q.data_ptr(), q_stride_token=row_stride(q), q_stride_head=row_stride(q, 1),
        k_cache=k_cache.data_ptr(), v_cache=v_cache.data_ptr(), out=out.data_ptr(), out_stride_token=row_stride(out),
        out_stride_head=row_stride(out, 1), lse=lse.data_ptr() if lse is not None else 0, ws_out=ws[0].data_ptr(),
        ws_lse=ws[1].data_ptr(), ws_start=step["ws_start"].data_ptr(), block_tables=tables.data_ptr(),
        query_start_loc=step["qsl"].data_ptr(), context_lens=step["ctx"].data_ptr(), num_rows=meta.num_rows,
        num_q_heads=num_heads, num_kv_heads=num_kv_heads, head_dim_qk=head_dim, head_dim_v=head_dim_v,
        block_size=meta.block_size, max_blocks_per_row=tables.shape[1], max_query_len=int(meta.max_query_len),
        max_num_tokens=q.shape[0], max_splits=max_splits, split_block=SPLIT_BLOCK,
        fixed_splits=fixed, scale=float(scale), dtype=DTYPE_CODE[q.dtype],
        pdl=config.pdl, num_sms=num_sms(q.device), gqa_fma=config.gqa_fma,
        gqa_pairs_per_block=config.gqa_pairs_per_block,
    )
    with torch.cuda.device(q.device):
        kernels.paged_attention(p, stream(q.device))
    return (out, lse) if return_lse else out


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                    return_lse: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    head_dim = k_cache.shape[3]
    if q.dtype not in _ATTENTION_DTYPES or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype or head_dim not in (64, 128, 256):
        if get_kernel_config().batch_invariant:  # the padded reference's sums change with the step
            return paged_attention_per_query(q, k_cache, v_cache, meta, scale, return_lse=return_lse)
        return reference.paged_attention(q, k_cache, v_cache, meta, scale, return_lse=return_lse)
    return launch_paged_attention(q, k_cache, v_cache, meta, scale, return_lse, k_cache.shape[2], head_dim)
