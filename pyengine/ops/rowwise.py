"""Elementwise transcendentals whose bits do not depend on the tensor's size (CPU)."""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def rowwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """fn (an elementwise transcendental: sigmoid, silu, softplus, exp) of a 2-D x with each row's
    bits independent of the number of rows. torch's CPU kernels run whole SIMD chunks through a
    vector exp and the leftover elements through a scalar one, which differ in the last bit, and
    which elements are left over depends on the tensor's size; padding every row to a multiple of
    64 values sends each element down the vector path."""
    if x.device.type != "cpu" or x.shape[-1] % 64 == 0:
        return fn(x)
    return fn(F.pad(x, (0, -x.shape[-1] % 64)))[:, :x.shape[-1]]
