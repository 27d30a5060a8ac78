"""Decode of the default model with a core taken by another process (issue 24's busy core).

For each thread count (torch.set_num_threads) and each of: nothing beside it / a spinning process
(`python -c "while True: pass"`, started before the engine and killed after it), two variants
take turns in fresh processes (round by round, so a burst of other load hits both alike):
  before  the pool as it was: exactly that many threads (set_pool_threads(N)) and every job handed
          to the workers however long a descheduled one keeps the caller waiting (set_pool_adaptive(False))
  after   threads capped by the cores free at start-up (set_pool_threads("auto"), opt-in since
          results/busy_core_cpu.json) and the stall policy (csrc/cpu/cpu_pool_policy.h, on by default)
Per process: decode_tok_s = --max-tokens / (time(prompt + 1 + max_tokens) - time(prompt + 1)), best of
--repeats after a warm-up, greedy, no prefix caching; the pool's thread count and job counts
(parallel, solo, stalls); /proc/loadavg before and after. Medians over --rounds go to the JSON.

    python benchmarks/bench_busy_core.py [--threads 1 2] [--rounds 3] [--max-tokens 64] [--out FILE]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_load import loadavg, machine, run_child  # noqa: E402

DEFAULT_OUT = os.path.join(ROOT, "benchmarks", "results", "busy_core_cpu.json")
CHAT = "What is the capital of France? Answer in two sentences."

CHILD = r"""
import json, sys, time
threads, adaptive, max_tokens, repeats = int(sys.argv[1]), sys.argv[2] == "1", int(sys.argv[3]), int(sys.argv[4])
import torch
torch.set_num_threads(threads)
from pyengine import LLM, SamplingParams, _C
from pyengine.ops.cpu.threads import pool_threads_for, set_pool_threads
set_pool_threads(threads if not adaptive else "auto")
llm = LLM(enable_prefix_caching=False)
_C.cpu.set_pool_adaptive(adaptive)
ids = llm.tokenizer.encode(sys.stdin.read())
def gen(n):
    p = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    return list(llm.run_requests([(None, ids)], [p])[0].output_token_ids)
def best(fn):
    t = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter(); fn(); t = min(t, time.perf_counter() - t0)
    return t
gen(2)
before = _C.cpu.pool_stats()
t1, tn = best(lambda: gen(1)), best(lambda: gen(1 + max_tokens))
after = _C.cpu.pool_stats()
print(json.dumps({"decode_tok_s": max_tokens / (tn - t1), "pool_threads": pool_threads_for(threads),
                  **{k: after[k] - before[k] for k in after}}))
"""


def run_variant(variant: str, threads: int, spin: bool, args: argparse.Namespace) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=ROOT)
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if spin else None
    try:
        if spinner:
            time.sleep(0.5)  # running before the engine starts, as a busy core would be
        before = loadavg()
        argv = ["-c", CHILD, str(threads), "0" if variant == "before" else "1", str(args.max_tokens), str(args.repeats)]
        result, _, _ = run_child(argv, CHAT.encode(), env, ROOT)
    finally:
        if spinner:
            spinner.kill()
            spinner.wait()
    result["loadavg"] = [before, loadavg()]
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=3, help="processes per variant, thread count and spinner setting")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=DEFAULT_OUT)
    args = ap.parse_args()
    started, date = loadavg(), datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    runs: dict[str, list[dict[str, Any]]] = {}
    for r in range(args.rounds):
        for threads in args.threads:
            for spin in (False, True):
                for variant in (("before", "after") if r % 2 == 0 else ("after", "before")):
                    res = run_variant(variant, threads, spin, args)
                    runs.setdefault(f"{threads}|{int(spin)}|{variant}", []).append(res)
                    print(f"round {r + 1} threads={threads} spinner={spin} {variant}: {res['decode_tok_s']:.1f} tok/s "
                          f"pool {res['pool_threads']} stalls {res['stalls']} solo {res['solo_jobs']} "
                          f"load {res['loadavg'][0][0]}", file=sys.stderr, flush=True)
    rows = []
    for threads in args.threads:
        for spin in (False, True):
            row: dict[str, Any] = {"threads": threads, "spinner": spin}
            for variant in ("before", "after"):
                rs = runs[f"{threads}|{int(spin)}|{variant}"]
                row[variant] = {"decode_tok_s_median": round(statistics.median(x["decode_tok_s"] for x in rs), 1),
                                "runs": [{k: (round(v, 1) if isinstance(v, float) else v) for k, v in x.items()}
                                         for x in rs]}
            row["after_over_before"] = round(row["after"]["decode_tok_s_median"] / row["before"]["decode_tok_s_median"], 2)
            rows.append(row)
    out = {
        "benchmark": "decode of the default model beside a spinning process, pool before vs after (issue 24)",
        "machine": machine(),
        "date": date,
        "command": "python benchmarks/bench_busy_core.py " + shlex.join(sys.argv[1:]),
        "loadavg": {"start": started, "end": loadavg()},
        "note": ("shared machine: other engineers' jobs ran throughout (loadavg per process recorded); "
                 "variants alternate within each round"),
        "rows": rows,
    }
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
