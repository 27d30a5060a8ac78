"""What every CUDA backend module needs to launch a kernel of hipkernels/ (pyengine._C.kernels):
the extension, dtype codes, the current stream, the device's multiprocessor count, and `params`,
which fills a kernel's params struct (pointers as integers: the extension never sees torch)."""
from __future__ import annotations

from typing import Any, Callable

import torch

from pyengine.ops.streams import raw_stream

try:
    from pyengine import _C

    kernels: Any = _C.kernels if getattr(_C, "has_kernels", False) else None
except ImportError:  # extension not built
    kernels = None

if kernels is None:
    raise ImportError("pyengine._C was built without GPU kernels (PYENGINE_KERNELS=OFF or no nvcc)")

DTYPE_CODE = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}  # PeDType
_NUM_SMS: dict[int, int] = {}
stream = raw_stream  # a launch's stream: the device's current one (a cudaStream_t integer)


def num_sms(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    n = _NUM_SMS.get(index)
    if n is None:
        n = _NUM_SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return n


def ptr(t: torch.Tensor | None) -> int:
    """A tensor's device address, 0 for None (an absent optional input)."""
    return 0 if t is None else t.data_ptr()


def params(cls: Any, **fields: Any) -> Any:
    """cls() (a params struct of the extension, its C++ defaults) with `fields` set."""
    p = cls()
    for name, value in fields.items():
        setattr(p, name, value)
    return p


def cached_params(cache: dict, key: tuple, make: Callable[[], Any], limit: int = 64) -> Any:
    """cache[key], made by make() on a miss: the params struct of a launch whose buffers come back
    every step (a graph's static tensors), which filling field by field would cost more host time
    than a small kernel. The cache is emptied when it outgrows `limit` (buffers gone)."""
    p = cache.get(key)
    if p is None:
        if len(cache) >= limit:
            cache.clear()
        p = cache[key] = make()
    return p


def row_stride(t: torch.Tensor, dim: int = 0) -> int:
    """t.stride(dim) as a kernel should see it. torch gives a dimension of size 1 any stride (a
    one-token [1, H] view of a transposed table has stride (1, 1)); a kernel that picks its
    vectorised path from the strides would then sum a lone token in another order than the same
    token in a batch. The stride of one row is never used, so report the dense one."""
    if t.shape[dim] != 1 or dim + 1 >= t.dim():
        return t.stride(dim)
    return t.shape[dim + 1] * row_stride(t, dim + 1)


def aligned_rows(x: torch.Tensor) -> torch.Tensor:
    """x with a contiguous last dim, 16-byte aligned base and row strides (copies only if needed);
    pass row_stride(x) as its row stride."""
    vec = 16 // x.element_size()
    if x.stride(-1) == 1 and x.data_ptr() % 16 == 0 and all(row_stride(x, d) % vec == 0 for d in range(x.dim() - 1)):
        return x
    return x.contiguous()


def slots(slot_mapping: torch.Tensor) -> torch.Tensor:
    """slot_mapping (int64 [T], validated by the facade) as the kernels read it."""
    return slot_mapping.contiguous()
