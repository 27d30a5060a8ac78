"""Greedy sampling's reductions of CPU logits in one C++ call (csrc/cpu/cpu_argmax.cpp)."""
from __future__ import annotations

import torch

from pyengine.ops.cpu.extension import kernels


def argmax_finite(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """[N, V] float32 CPU logits (last dim contiguous) -> (argmax int64 [N], finite bool [N]): the
    values of NumPy's argmax (the first maximum, or the first NaN) and of sampler.finite_rows (no
    NaN or +-inf in the row). None for another dtype, device or layout (the caller's NumPy path)."""
    if logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.dim() != 2 or logits.stride(1) != 1:
        return None
    n = logits.shape[0]
    tok = torch.empty(n, dtype=torch.int64)
    finite = torch.empty(n, dtype=torch.bool)
    kernels.argmax_rows(logits.data_ptr(), n, logits.shape[1], logits.stride(0), tok.data_ptr(), finite.data_ptr())
    return tok, finite
