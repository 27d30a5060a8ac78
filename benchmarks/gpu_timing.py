"""GPU timing shared by the benchmarks: CUDA-event medians and the device copy bandwidth that
results are reported against (measured in the same run)."""
from __future__ import annotations

import datetime
import json
import os
import statistics
import sys
from typing import Callable

import torch


def time_ms(fn: Callable[[], object], reps: int = 20, warmup: int = 3) -> float:
    """Median milliseconds of fn() over reps runs, timed with CUDA events after a warm-up."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def time_ms_graph(fn: Callable[[], object], inner: int = 20, reps: int = 10) -> float:
    """Median milliseconds of one fn() inside a CUDA graph of `inner` back-to-back calls: the
    kernels' own time, without the Python launch overhead that a decode step also keeps out of
    its CUDA graph. Falls back to time_ms where fn cannot be captured."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for _ in range(inner):
                fn()
    except RuntimeError:
        torch.cuda.synchronize()
        return time_ms(fn)
    return time_ms(graph.replay, reps=reps, warmup=2) / inner


def graph_ms(calls: list[Callable[[], object]], reps: int = 10) -> float:
    """Median ms of one call, from a CUDA graph that runs every call once, back to back (calls
    that must each stream their own weights from memory: one graph over many copies)."""
    for c in calls[:3]:
        c()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    return time_ms(graph.replay, reps=reps, warmup=3) / len(calls)


def copy_bandwidth_gbps(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read and written (random data)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), reps=20)
    return 2 * nbytes / ms / 1e6


def run_header() -> dict:
    """What every GPU result records first: device, UTC date, the command and torch's version."""
    return {"device": torch.cuda.get_device_name(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": "python3 " + " ".join(sys.argv), "torch": torch.__version__}


def write_result(path: str, result: dict) -> None:
    """The benchmark's JSON document at path (folders created)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print("wrote", path)
