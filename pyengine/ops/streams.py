"""The current CUDA stream, cheaply, for per-step launches and event records.

torch.cuda.current_stream() builds a torch.cuda.Stream object on every call, and Event.record()
without a stream calls it. On the H100 device host that made an event record ~50-75 us and a
kernel launch from Python ~80-115 us (line profile of a batch-1 suffix run), several of them on a
drafting step's critical path between its predecessor's tokens and its own replay. Here the raw
handle comes from torch's C++ getter, and a Stream object is made only when the device's current
stream changes (the last one is kept per device): the event lands on the current stream as before.
"""
from __future__ import annotations

import torch

_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # absent from CPU-only builds
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
