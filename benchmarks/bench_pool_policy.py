"""Decode of the default model under the CPU pool's policies, taking turns in one process (issue 24).

Variants, alternating round by round (a burst of other load on a shared machine hits them alike):
  1 thread            the pool at one thread
  2 threads, stalls   the workers held back only after a stall (the policy before absent workers)
  2 threads, absent   also after a window where the workers ran under half their share of the
                      chunks (csrc/cpu/cpu_pool_policy.h, the default)
Per measurement: decode_tok_s = --max-tokens / (time(prompt + 1 + max_tokens) - time(prompt + 1)),
best of --repeats, greedy, no prefix caching; the pool's job counts, the workers' share of the
chunks, /proc/loadavg. Every variant's tokens must equal the first's (the policy changes no bit).

    python benchmarks/bench_pool_policy.py [--rounds 6] [--max-tokens 48] [--out FILE]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import statistics
import sys
import time
from typing import Any

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_load import loadavg, machine  # noqa: E402

DEFAULT_OUT = os.path.join(ROOT, "benchmarks", "results", "pool_policy_cpu.json")
CHAT = "What is the capital of France? Answer in two sentences."
VARIANTS = {"1 thread": (1, 0.5), "2 threads, stalls": (2, 0.0), "2 threads, absent": (2, 0.5)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--note", default="")
    ap.add_argument("--out", default=DEFAULT_OUT)
    args = ap.parse_args()
    torch.set_num_threads(2)
    from pyengine import LLM, SamplingParams, _C

    llm = LLM(enable_prefix_caching=False)
    ids = llm.tokenizer.encode(CHAT)

    def gen(n: int) -> list[int]:
        p = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        return list(llm.run_requests([(None, ids)], [p])[0].output_token_ids)

    def best(n: int) -> float:
        t = float("inf")
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            gen(n)
            t = min(t, time.perf_counter() - t0)
        return t

    started, date = loadavg(), datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in VARIANTS}
    want = None
    for r in range(args.rounds):
        for name in (list(VARIANTS) if r % 2 == 0 else list(reversed(VARIANTS))):
            threads, fraction = VARIANTS[name]
            _C.cpu.set_num_threads(threads)
            _C.cpu.set_pool_adaptive(True)
            _C.cpu.set_pool_absent_fraction(fraction)
            tokens = gen(1 + args.max_tokens)
            want = want or tokens
            if tokens != want:
                raise SystemExit(f"{name}: tokens differ from the first variant's")
            before, load = _C.cpu.pool_stats(), loadavg()
            rate = args.max_tokens / (best(1 + args.max_tokens) - best(1))
            after = _C.cpu.pool_stats()
            d = {k: after[k] - before[k] for k in after}
            res = {"decode_tok_s": round(rate, 1), "workers_share": round(d["worker_chunks"] / max(1, d["chunks"]), 3),
                   **{k: d[k] for k in ("parallel_jobs", "solo_jobs", "stalls", "solo_periods")},
                   "loadavg": [load, loadavg()]}
            runs[name].append(res)
            print(f"round {r + 1} {name}: {res}", file=sys.stderr, flush=True)
    out = {
        "benchmark": "decode of the default model, CPU pool policies alternating in one process (issue 24)",
        "machine": machine(), "date": date,
        "command": "python benchmarks/bench_pool_policy.py " + shlex.join(sys.argv[1:]),
        "loadavg": {"start": started, "end": loadavg()}, "note": args.note,
        "medians_tok_s": {k: round(statistics.median(x["decode_tok_s"] for x in v), 1) for k, v in runs.items()},
        "runs": runs,
    }
    previous = []
    if os.path.exists(args.out):
        with open(args.out, encoding="utf-8") as f:
            previous = json.load(f).get("history", [])
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump({"history": previous + [out]}, f, indent=1)
        f.write("\n")
    print(json.dumps(out["medians_tok_s"]))


if __name__ == "__main__":
    main()
