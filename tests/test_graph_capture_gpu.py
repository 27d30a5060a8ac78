"""capture_graph on the GPU: a garbage collection during a capture must not destroy another graph
(a dropped engine's graphs sit in reference cycles; destroying a graph while a stream captures
invalidates the capture: cudaErrorStreamCaptureInvalidated)."""
from __future__ import annotations

import gc

import pytest
import torch

from pyengine.engine.graph_capture import capture_graph

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_a_collection_during_capture_does_not_free_another_graph() -> None:
    dev = torch.device("cuda")
    x = torch.arange(16, dtype=torch.float32, device=dev)
    old_graph, _ = capture_graph(lambda: x + 1, dev, None)
    held = [old_graph]
    del old_graph
    calls = []

    def forward() -> torch.Tensor:
        calls.append(1)
        if len(calls) == 3:  # the captured call: the old graph becomes garbage only a collection frees
            cycle: list = [held.pop()]
            cycle.append(cycle)
            del cycle
            kept = [[] for _ in range(1000)]  # container allocations kept: collections at the thresholds below
            assert len(kept) == 1000
        return x * 2 + 1

    thresholds = gc.get_threshold()
    gc.set_threshold(1, 1, 1)
    try:
        graph, out = capture_graph(forward, dev, None)
    finally:
        gc.set_threshold(*thresholds)
    assert len(calls) == 3 and not held
    gc.collect()  # the old graph goes now, outside any capture
    x.fill_(3.0)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, torch.full_like(x, 7.0))
