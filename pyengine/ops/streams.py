"""The current CUDA stream, cheaply, for per-step launches, copies and event records.

torch.cuda.current_stream() builds a torch.cuda.Stream object on every call, and Event.record()
without a stream calls it. On the H100 device host that made an event record ~50-75 us and a
kernel launch from Python ~80-115 us (line profile of a batch-1 suffix run), several of them on a
drafting step's critical path between its predecessor's tokens and its own replay. Here the raw
handle comes from torch's C++ getter, and a Stream object is made only when the device's current
stream changes (the last one is kept per device): the event lands on the current stream as before.
A step's small copies (staging, token ids, the sampled tokens back) and the event behind them go
through one runtime call (copy_async) instead of torch's copy_ (~25-37 us each) and record.
"""
from __future__ import annotations

import torch

_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # absent from CPU-only builds
try:  # the runtime's copy (hipkernels/common/runtime.h), with the GPU kernels
    from pyengine import _C

    _copy_async = getattr(_C.kernels, "copy_async", None) if getattr(_C, "has_kernels", False) else None
except ImportError:  # extension not built
    _copy_async = None
_last: dict[int, tuple[int, torch.cuda.Stream]] = {}  # device index -> (raw handle, its Stream)


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def raw_stream(device: torch.device) -> int:
    """The device's current stream as a cudaStream_t integer (what a kernel launch takes)."""
    index = _index(device)
    return _raw_stream(index) if _raw_stream is not None else torch.cuda.current_stream(index).cuda_stream


def current_stream(device: torch.device) -> torch.cuda.Stream:
    """torch.cuda.current_stream(device), made once per stream."""
    index = _index(device)
    raw = raw_stream(device)
    last = _last.get(index)
    if last is None or last[0] != raw:
        last = _last[index] = (raw, torch.cuda.current_stream(index))
    return last[1]


def record(event: torch.cuda.Event, device: torch.device) -> None:
    """event.record() on the device's current stream."""
    event.record(current_stream(device))


def copy_async(dst: torch.Tensor, src: torch.Tensor, device: torch.device, event: torch.cuda.Event | None = None) -> None:
    """dst.copy_(src, non_blocking=True) (one of them on `device`; a host side pinned keeps it
    asynchronous), then event.record() if given, on the device's current stream: in one runtime
    call where both are contiguous of one dtype and size, the device is CUDA, the build has the GPU
    kernels and the event exists (torch makes it on its first record), else through torch."""
    handle = 0 if event is None else event.cuda_event
    if (_copy_async is None or device.type != "cuda" or (event is not None and not handle) or dst.dtype != src.dtype
            or dst.numel() != src.numel() or not dst.is_contiguous() or not src.is_contiguous()):
        dst.copy_(src, non_blocking=True)
        if event is not None:
            record(event, device)
        return
    _copy_async(dst.data_ptr(), src.data_ptr(), dst.numel() * dst.element_size(), handle, raw_stream(device))
