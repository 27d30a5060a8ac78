"""What a step graph is and how one is captured: graph keys and their shapes, the buckets, the
capture itself (shared by CudaGraphRunner, HeadGraphs and DraftChain), and whether a model can
run on graphs at all."""
from __future__ import annotations

import gc
from typing import Any, Callable

import torch

from pyengine.engine.attention_metadata import AttentionMetadata


def default_token_buckets(max_tokens: int) -> list[int]:
    """Prefill graphs' token capacities: 16, 32, 64, ... up to max_tokens (none below 16)."""
    out, t = [], 16
    while t <= max_tokens:
        out.append(t)
        t *= 2
    return out


def graph_shape(key: tuple[int, int]) -> tuple[int, int, int, bool]:
    """(rows b, max query length q, token slots, prefill-shaped) of a graph key: decode/verify (b, q):
    every token's logits, b * q slots; prefill-shaped (b, -t): t slots, one row may hold them all, the
    logits of chosen tokens only (a prefill graph's staged list, a drafting layer's rows' last tokens)."""
    b, q = key
    return (b, q, b * q, False) if q > 0 else (b, -q, -q, True)


def last_tokens(meta: AttentionMetadata, rows: int | None = None) -> torch.Tensor:
    """Each row's last token index (of the first `rows` rows; an empty padding row repeats the
    token before it): the rows whose logits a prefill or drafting-layer graph computes."""
    ends = meta.query_start_loc[1:] if rows is None else meta.query_start_loc[1:rows + 1]
    return (ends - 1).clamp_(min=0)


def capture_graph(forward: Callable[[], Any], device: torch.device, pool) -> tuple[torch.cuda.CUDAGraph, Any]:
    """forward() run twice on a side stream (warm-up: cuBLAS handles and workspaces, lazy module
    init), then captured into a graph in `pool`: (the graph, forward's static outputs). Python's
    cyclic garbage collector is off during the capture: a collection there may free another
    graph (a dropped engine's), and destroying a graph while a stream captures invalidates the
    capture (torch no longer collects before capturing)."""
    s = torch.cuda.Stream(device)
    s.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(s):
        for _ in range(2):
            forward()
    torch.cuda.current_stream(device).wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    collecting = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool):
            out = forward()
    finally:
        if collecting:
            gc.enable()
    torch.cuda.synchronize(device)
    return graph, out


def default_buckets(max_num_seqs: int) -> list[int]:
    """Powers of two below max_num_seqs, then max_num_seqs itself."""
    out, b = [], 1
    while b < max_num_seqs:
        out.append(b)
        b *= 2
    return out + [max_num_seqs]


def graphs_supported(model, config, dtype: torch.dtype, device: torch.device) -> tuple[bool, str]:
    """Graphs need the CUDA attention kernels (the reference fallback is not capturable); a model
    without attention layers (Mamba2) needs only the state kernels, in any dtype."""
    if device.type != "cuda":
        return False, "not a CUDA device"
    if not getattr(model, "supports_cuda_graphs", True):
        return False, f"{config.architecture} runs eagerly (data-dependent expert dispatch)"
    if getattr(model, "uses_kv_cache", True):  # attention layers: the kernels must take them
        if dtype not in (torch.float16, torch.bfloat16):
            return False, f"dtype {dtype} runs the reference attention"
        mla_ok = getattr(model, "mla_kernel_widths", None)
        if mla_ok is False:
            return False, "MLA widths other than 512 + 64 run the reference attention"
        if mla_ok is None and config.head_dim not in (64, 128, 256):
            return False, f"head_dim {config.head_dim} runs the reference attention"
    try:
        from pyengine.ops import cuda as _  # noqa: F401
    except ImportError as e:
        return False, str(e)
    return True, ""
