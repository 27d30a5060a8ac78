"""Host (numpy) arrays onto the device without waiting for the stream.

A plain `torch.from_numpy(a).to(device)` copies synchronously: the host waits until the stream has
run everything queued before the copy. While a step launched ahead (async decode) runs, that is the
whole next forward, and the host's work meant to overlap it waits instead. `non_blocking=True` alone
does not help for pageable memory (the copy still waits), so the array goes through page-locked
memory from torch's caching host allocator, which keeps the block until the copy has run.
"""
from __future__ import annotations

import numpy as np
import torch


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """`array` as a tensor on `device` (itself on the CPU), queued on the current stream."""
    t = torch.from_numpy(np.ascontiguousarray(array))
    return t if device.type == "cpu" else t.pin_memory().to(device, non_blocking=True)
