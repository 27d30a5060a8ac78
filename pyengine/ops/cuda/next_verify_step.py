"""CUDA launch of hipkernels/spec/next_verify_step.h: the verify step after a greedy step, built
on the device from its argmax (acceptance, history, prompt-lookup drafts, the graph's static
inputs). Same arguments and semantics as pyengine/ops/reference/next_verify_step.py."""
from __future__ import annotations

import torch

from pyengine.ops.cuda.launch import cached_params, kernels, params, stream


_PARAMS: dict[tuple, object] = {}  # (the buffers' addresses and the fixed sizes) -> params: cached_params


def next_verify_step(argmax: torch.Tensor, rows_in: torch.Tensor, sync_tokens: torch.Tensor, history: torch.Tensor,
                     block_tables: torch.Tensor, inputs: torch.Tensor, result: torch.Tensor, *, block_size: int,
                     max_context: int, token_capacity: int, row_capacity: int, rows: int, padded_rows: int, q: int,
                     token_slots: int, max_drafts: int, min_n: int, max_n: int, phase: int = 0,
                     layer_drafts: torch.Tensor | None = None) -> None:
    fixed = (rows_in.data_ptr(), sync_tokens.data_ptr(), history.data_ptr(), block_tables.data_ptr(),
             inputs.data_ptr(), result.data_ptr(), history.stride(0), block_tables.shape[1], result.stride(0),
             block_size, max_context, token_capacity, row_capacity, max_drafts, min_n, max_n)
    assert argmax.dtype == rows_in.dtype == inputs.dtype == result.dtype == torch.int64
    assert sync_tokens.dtype == history.dtype == block_tables.dtype == torch.int32
    p = cached_params(_PARAMS, fixed, lambda: params(
        kernels.NextVerifyStepParams, rows_in=fixed[0], sync_tokens=fixed[1], history=fixed[2],
        block_tables=fixed[3], inputs=fixed[4], result=fixed[5], history_stride=fixed[6], table_width=fixed[7],
        result_stride=fixed[8], block_size=block_size, max_context=max_context, token_capacity=token_capacity,
        row_capacity=row_capacity, max_drafts=max_drafts, min_n=min_n, max_n=max_n), limit=16)
    assert history.is_contiguous() and block_tables.is_contiguous() and result.is_contiguous()
    p.argmax, p.rows, p.padded_rows, p.q, p.token_slots = argmax.data_ptr(), rows, padded_rows, q, token_slots
    p.phase = phase
    if layer_drafts is not None:
        assert layer_drafts.dtype == torch.int64 and layer_drafts.stride(1) == 1
        p.layer_drafts, p.layer_stride = layer_drafts.data_ptr(), layer_drafts.stride(0)
    else:
        p.layer_drafts, p.layer_stride = 0, 0
    kernels.next_verify_step(p, stream(argmax.device))
