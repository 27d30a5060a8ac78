"""CUDA launch of hipkernels/spec/next_verify_step.h: the verify step after a greedy step, built
on the device from its argmax (acceptance, history, prompt-lookup drafts, the graph's static
inputs). Same arguments and semantics as pyengine/ops/reference/next_verify_step.py."""
from __future__ import annotations

import torch

from pyengine.ops.cuda.launch import kernels, params, stream


def next_verify_step(argmax: torch.Tensor, rows_in: torch.Tensor, sync_tokens: torch.Tensor, history: torch.Tensor,
                     block_tables: torch.Tensor, inputs: torch.Tensor, result: torch.Tensor, *, block_size: int,
                     max_context: int, token_capacity: int, row_capacity: int, rows: int, padded_rows: int, q: int,
                     token_slots: int, max_drafts: int, min_n: int, max_n: int) -> None:
    assert argmax.dtype == rows_in.dtype == inputs.dtype == result.dtype == torch.int64
    assert sync_tokens.dtype == history.dtype == block_tables.dtype == torch.int32
    assert history.is_contiguous() and block_tables.is_contiguous() and result.is_contiguous()
    p = params(kernels.NextVerifyStepParams, argmax=argmax.data_ptr(), rows_in=rows_in.data_ptr(),
               sync_tokens=sync_tokens.data_ptr(), history=history.data_ptr(), history_stride=history.stride(0),
               block_tables=block_tables.data_ptr(), table_width=block_tables.shape[1], block_size=block_size,
               max_context=max_context, inputs=inputs.data_ptr(), token_capacity=token_capacity,
               row_capacity=row_capacity, rows=rows, padded_rows=padded_rows, q=q, token_slots=token_slots,
               max_drafts=max_drafts, result=result.data_ptr(), result_stride=result.stride(0), min_n=min_n,
               max_n=max_n)
    kernels.next_verify_step(p, stream(argmax.device))
