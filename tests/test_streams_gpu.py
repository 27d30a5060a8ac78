"""pyengine/ops/streams.py: the current stream without a torch Stream object per call. Launches and
event records must follow the current stream wherever it moves (a `torch.cuda.stream` context, as
graph capture uses), not a stream seen earlier: an event on a stale stream would let the host read
a copy that has not landed."""
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
