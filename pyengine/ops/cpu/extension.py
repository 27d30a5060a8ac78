"""The CPU backend's link to the C++ ops of pyengine._C.cpu (csrc/cpu/): the extension, dtype codes,
and the helpers every CPU backend module uses. Like the GPU kernels, the extension gets raw data
pointers, sizes and row strides; it never sees torch."""
from __future__ import annotations

from typing import Any

import torch

try:
    from pyengine import _C

    kernels: Any = _C.cpu
except (ImportError, AttributeError) as exc:  # extension not built, or built before these ops
    raise ImportError("pyengine._C has no CPU layer ops") from exc

DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1}


def raise_error(error: str) -> None:
    """The C++ ops report misuse as a message rather than an exception (csrc/cpu/cpu_ops.h says why)."""
    if error:
        raise ValueError(error)


def heads_contiguous(x: torch.Tensor) -> bool:
    """[T, H, D] whose heads are contiguous inside a token row (rows may be strided)."""
    return x.stride(2) == 1 and x.stride(1) == x.shape[2]


def pool_threads() -> bool:
    """Whether the C++ pool may split the work: only while torch runs one thread, i.e. inside an
    engine step of a model that owns the CPU threads (ModelRunner.step_threads); with torch's
    OpenMP workers active, pool workers would fight them for the cores."""
    return torch.get_num_threads() == 1
