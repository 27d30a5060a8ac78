"""pyengine/ops/streams.py: the current stream without a torch Stream object per call, and a step's
copies through one runtime call. Launches, copies and event records must follow the current stream
wherever it moves (a `torch.cuda.stream` context, as graph capture uses), not a stream seen
earlier: an event on a stale stream would let the host read a copy that has not landed."""
from __future__ import annotations

import pytest
import torch

from pyengine.ops import streams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_the_current_stream_follows_stream_contexts() -> None:
    dev = torch.device("cuda")
    default = torch.cuda.current_stream()
    assert streams.current_stream(dev) == default and streams.raw_stream(dev) == default.cuda_stream
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        assert streams.current_stream(dev) == side and streams.raw_stream(dev) == side.cuda_stream
    assert streams.current_stream(dev) == default


def test_an_event_is_recorded_on_the_current_stream() -> None:
    """An event recorded with record() inside a side-stream context lands behind that stream's work:
    timed against an event recorded before a long kernel there, it comes milliseconds later (on the
    idle default stream, the stream kept from the first call, it would complete at once)."""
    dev = torch.device("cuda")
    streams.record(torch.cuda.Event(), dev)  # the default stream is the one kept
    side = torch.cuda.Stream()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(side):
        start.record(side)
        torch.cuda._sleep(20_000_000)  # ~10 ms of GPU clock cycles
        streams.record(end, dev)
    end.synchronize()
    assert start.elapsed_time(end) > 2.0
    torch.cuda.synchronize()


@pytest.mark.parametrize("direction", ["h2d", "d2d", "d2h"])
def test_copy_async_copies_then_records_behind_the_streams_work(direction: str) -> None:
    """The copy lands (every direction the engine uses: staging, token ids, sampled tokens back) and
    its event completes only after the work queued before it on the current stream."""
    dev = torch.device("cuda")
    src = torch.arange(1000, dtype=torch.int64) * 7 - 3
    src = src.to(dev) if direction != "h2d" else src.pin_memory()
    dst = torch.zeros(1000, dtype=torch.int64, device=dev) if direction != "d2h" else \
        torch.zeros(1000, dtype=torch.int64).pin_memory()
    event = torch.cuda.Event(enable_timing=True)
    event.record()  # torch makes the event; copy_async then records it itself
    start = torch.cuda.Event(enable_timing=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        start.record(side)
        torch.cuda._sleep(20_000_000)
        streams.copy_async(dst, src, dev, event)
    event.synchronize()
    assert start.elapsed_time(event) > 2.0
    assert torch.equal(dst.cpu(), src.cpu())
    torch.cuda.synchronize()


def test_copy_async_takes_torch_s_path_where_the_runtime_call_does_not_apply() -> None:
    """A strided source, another dtype, and an event torch has not made yet: the same result."""
    dev = torch.device("cuda")
    base = torch.arange(64, dtype=torch.int64, device=dev)
    dst = torch.zeros(32, dtype=torch.int64, device=dev)
    streams.copy_async(dst, base[::2], dev)
    assert torch.equal(dst, base[::2])
    f32 = torch.zeros(32, dtype=torch.float32, device=dev)
    streams.copy_async(f32, base[:32], dev)
    assert torch.equal(f32, base[:32].float())
    fresh = torch.cuda.Event()
    host = torch.zeros(32, dtype=torch.int64).pin_memory()
    streams.copy_async(host, base[:32], dev, fresh)
    fresh.synchronize()
    assert torch.equal(host, base[:32].cpu())
