"""CUDA greedy sampling's per-row reduction (hipkernels/sampling/greedy_rows.h): argmax and finite
flag of each fp32 logits row in one launch, into one int64 buffer [argmax | flags]."""
from __future__ import annotations

import torch

from pyengine.ops.cuda.launch import cached_params, kernels, params, row_stride, stream


def greedy_rows_into(logits: torch.Tensor, out: torch.Tensor) -> bool:
    """out[:N] = each row's argmax (the first maximum, NaN above every number, as torch.argmax),
    out[N:2N] = 1 where the row is all finite, else 0, for fp32 logits [N, V] with a contiguous last
    dim; out: int64 [2N] on the same device. False (nothing launched) for other logits."""
    if logits.dtype != torch.float32 or logits.dim() != 2 or logits.stride(1) != 1 or logits.shape[1] < 1:
        return False
    assert out.dtype == torch.int64 and out.is_contiguous() and out.numel() >= 2 * logits.shape[0]
    key = (logits.data_ptr(), out.data_ptr(), logits.shape[0], logits.shape[1], logits.stride(0))
    p = cached_params(_PARAMS, key, lambda: params(kernels.GreedyRowsParams, logits=key[0], out=key[1],
                                                   num_rows=key[2], vocab=key[3], row_stride=row_stride(logits)),
                      limit=256)
    device = logits.device
    if device.index is None or device.index == torch.cuda.current_device():
        kernels.greedy_rows(p, stream(device))
    else:
        with torch.cuda.device(device):  # the launch goes to the logits' device, whichever is current
            kernels.greedy_rows(p, stream(device))
    return True


_PARAMS: dict[tuple, object] = {}  # (logits address, out address, rows, vocabulary, row stride) -> params
