"""pyengine's packed CPU GEMM (pyengine.ops.cpu.PackedLinear) against oneDNN's prepacked linear on the
linears of one SmolLM2-135M decode step (30 layers' qkv, o, gate_up, down, and the lm_head), fp32 and
bf16, batch 1 and 16. The weights are random values put through GGUF's Q4_1 (layers) and Q8_0
(lm_head) quantisers and back, as the default model's file holds them; fp32 then also runs the
compact panels (codes + per-run scale and offset, csrc/cpu/cpu_gemm_affine.h) next to the dense ones.
All run in this process, taking turns, best of --repeats; PackedLinear with its own pool (torch at
one thread, as inside an engine step), oneDNN with torch's --threads. Prints JSON (ms per step of
linears and the dense weight bytes per second).

It also measures this machine's ceilings, to show what a decode step's linears can cost at best:
oneDNN's GEMM throughput on a cache-resident, compute-bound shape (fp32 and bf16) and the memory
bandwidth of a streaming read; `floor_ms` is max(FLOPs / GEMM throughput, weight bytes / bandwidth).
Where oneDNN cannot prepack a dtype (bf16 on CPUs without avx512bw/vl/dq or avx_ne_convert, e.g.
AVX2-only ones), the baseline is what the engine then runs: torch.mm on the dense [in, out] weight
(`baseline` in each row says which).

    python benchmarks/bench_cpu_gemm.py [--threads 2] [--repeats 5] [--batches 1 16] [--out FILE]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pyengine.ops.cpu import PackedLinear  # noqa: E402

SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)] * 30 + [(576, 49152)]  # [in, out]


def gguf_roundtrip(k: int, n: int, kind: str) -> torch.Tensor:
    """[in, out] fp32: random weights through a GGUF quantiser and back (blocks of 32 inputs)."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    kind_ = GGMLQuantizationType[kind]
    rows = (torch.randn(n, k) * 0.05).numpy()
    return torch.from_numpy(np.ascontiguousarray(dequantize(quantize(rows, kind_), kind_).astype(np.float32).T))


def best_ms(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def onednn_prepacks(dtype: torch.dtype) -> bool:
    try:
        w = torch.ops.mkldnn._reorder_linear_weight(torch.zeros(2, 2, dtype=dtype), None)
        torch.ops.mkldnn._linear_pointwise(torch.zeros(1, 2, dtype=dtype), w, None, "none", [], "")
        return True
    except (RuntimeError, NotImplementedError):
        return False


def baseline_linear(w: torch.Tensor):
    """[in, out] -> f(x): oneDNN's prepacked linear where it takes the dtype, else torch.mm (the
    engine's fallbacks in that order)."""
    if onednn_prepacks(w.dtype):
        packed = torch.ops.mkldnn._reorder_linear_weight(w.t().contiguous(), None)
        return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    return lambda x: torch.mm(x, w)


def ceilings(threads: int, repeats: int) -> dict:
    """Compute and bandwidth ceilings of this machine, measured with the same thread count."""
    torch.set_num_threads(threads)
    out: dict = {}
    m, k, n = 512, 576, 1024  # weights of 1.2-2.4 MB stay in cache: compute-bound
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(m, k).to(dtype)
        f = baseline_linear(torch.randn(k, n).to(dtype))
        ms = best_ms(lambda: [f(x) for _ in range(10)], repeats) / 10
        out[f"gemm_gflop_s_{str(dtype).replace('torch.', '')}"] = round(2 * m * k * n / ms / 1e6, 1)
    big = torch.ones(135_000_000)  # 540 MB, SmolLM2's fp32 weights, far beyond the caches
    out["stream_read_gb_s"] = round(big.numel() * 4 / best_ms(big.sum, repeats) / 1e6, 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16], help="rows M of x per linear")
    ap.add_argument("--out")
    args = ap.parse_args()
    result: dict = {"machine": platform.processor() or platform.machine(), "threads": args.threads,
                    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    "command": "python benchmarks/bench_cpu_gemm.py " + " ".join(
                        f"--{k} {v}" for k, v in (("threads", args.threads), ("repeats", args.repeats),
                                                   ("batches", " ".join(map(str, args.batches))))),
                    "loadavg_at_start": [round(x, 2) for x in os.getloadavg()], "rows": []}
    # Ceilings are maxima: measured before and after the GEMMs (interference only ever lowers them).
    first = ceilings(args.threads, args.repeats)
    quantised = [gguf_roundtrip(k, n, "Q8_0" if n == SHAPES[-1][1] else "Q4_1") for k, n in SHAPES]
    for dtype in (torch.float32, torch.bfloat16):
        torch.set_num_threads(args.threads)
        weights = [w.to(dtype) for w in quantised]
        packed = [PackedLinear(w, compact=False) for w in weights]  # pool threads = torch's count now
        compact = [PackedLinear(w) for w in weights] if dtype == torch.float32 else []
        isa = {2: "avx2", 3: "avx512"}.get(int(packed[0].packed.isa), "none")
        onednn = [baseline_linear(w) for w in weights]
        nbytes = sum(w.numel() * w.element_size() for w in weights)
        compact_bytes = sum(layer.packed_bytes for layer in compact)
        for m in args.batches:
            xs = {k: torch.randn(m, k).to(dtype) for k in (576, 1536)}

            def run_packed(layers: list[PackedLinear] = packed) -> None:
                for layer, (k, _) in zip(layers, SHAPES):
                    layer(xs[k])

            def run_onednn() -> None:
                for f, (k, _) in zip(onednn, SHAPES):
                    f(xs[k])

            times: dict[str, float] = {"packed": float("inf"), "onednn": float("inf"), "compact": float("inf")}
            for _ in range(2):  # turns, so a burst of interference cannot land on one side only
                torch.set_num_threads(1)
                times["packed"] = min(times["packed"], best_ms(run_packed, args.repeats))
                if compact:
                    times["compact"] = min(times["compact"], best_ms(lambda: run_packed(compact), args.repeats))
                torch.set_num_threads(args.threads)
                times["onednn"] = min(times["onednn"], best_ms(run_onednn, args.repeats))
            row = {"dtype": str(dtype).replace("torch.", ""), "batch": m, "packed_isa": isa,
                   "baseline": "onednn" if onednn_prepacks(dtype) else "torch.mm",
                   "packed_ms": round(times["packed"], 2), "onednn_ms": round(times["onednn"], 2),
                   "packed_gb_s": round(nbytes / times["packed"] / 1e6, 1),
                   "onednn_gb_s": round(nbytes / times["onednn"] / 1e6, 1),
                   "speedup": round(times["onednn"] / times["packed"], 3)}
            if compact:
                row["compact_ms"] = round(times["compact"], 2)
                row["compact_bytes"] = compact_bytes
                row["compact_speedup_vs_onednn"] = round(times["onednn"] / times["compact"], 3)
            row["flops"], row["bytes"] = 2 * m * sum(k * n for k, n in SHAPES), nbytes
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
    result["ceilings"] = {key: max(v, first[key]) for key, v in ceilings(args.threads, args.repeats).items()}
    for row in result["rows"]:
        gflop_s = result["ceilings"][f"gemm_gflop_s_{row['dtype']}"]
        compute_ms = row.pop("flops") / gflop_s / 1e6
        row["floor_ms"] = round(max(compute_ms, row.pop("bytes") / result["ceilings"]["stream_read_gb_s"] / 1e6), 2)
        if "compact_bytes" in row:
            row["compact_floor_ms"] = round(max(compute_ms, row["compact_bytes"] / result["ceilings"]["stream_read_gb_s"] / 1e6), 2)
    text = json.dumps(result, indent=1)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
