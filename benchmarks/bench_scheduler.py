"""Block manager + scheduler cost per step, with no model.

N running requests, k drafts each, random acceptance, prefix caching on. Times the calls a decode
step makes into the C++ core (set drafts, schedule, update); the numpy work that fakes the sampler
is timed separately. Prints one JSON line last: {"us_per_step": ...}.

    python benchmarks/bench_scheduler.py --num-seqs 1024 --num-spec-tokens 4 --json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time

import numpy as np

from pyengine import _C


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-seqs", type=int, default=1024)
    ap.add_argument("--num-spec-tokens", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print only the JSON result")
    args = ap.parse_args()
    n, k, rng = args.num_seqs, args.num_spec_tokens, np.random.default_rng(args.seed)

    max_len = args.prompt_len + (args.steps + 10) * (k + 1) + 8
    cfg = _C.SchedulerConfig()
    cfg.max_num_seqs = n
    cfg.max_num_batched_tokens = n * (k + 1) + args.prompt_len * n
    cfg.max_model_len = max_len
    cfg.block_size = args.block_size
    cfg.num_kv_blocks = n * (-(-max_len // args.block_size)) + 16
    cfg.enable_prefix_caching = True
    cfg.num_spec_tokens = k
    sched = _C.Scheduler(cfg)
    shared = rng.integers(0, 32000, size=args.prompt_len // 2).tolist()  # half the prompt is shared
    for sid in range(n):
        prompt = shared + rng.integers(0, 32000, size=args.prompt_len - len(shared)).tolist()
        sched.add_request(sid, prompt, max_len - args.prompt_len)

    core_s = driver_s = 0.0
    ids = np.arange(n, dtype=np.int64)
    for step in range(args.steps + 2):
        timed = step >= 2  # the first steps are prefills
        drafts = rng.integers(0, 32000, size=n * k).astype(np.int32)
        counts = np.full(n, k, dtype=np.int32)
        t0 = time.perf_counter()
        if step >= 1:
            sched.set_draft_tokens_batch(ids, drafts, counts)
        batch = sched.schedule()
        t1 = time.perf_counter()
        # fake sampler: accept a random prefix of each row's drafts, then one new token
        num_logits = batch.num_logits
        d = batch.num_draft_tokens
        accepted = np.where(num_logits > 0, rng.integers(0, d + 1), -1).astype(np.int32) + 1
        tokens_in = batch.input_ids
        starts = batch.query_start_loc[:-1]
        pos = np.arange(int(accepted.max(initial=0)))
        take = pos[None, :] < accepted[:, None]
        src = (starts[:, None] + 1 + pos[None, :]).clip(max=len(tokens_in) - 1)
        out = np.where(pos[None, :] < (accepted - 1)[:, None], tokens_in[src], 7)[take].astype(np.int32)
        t2 = time.perf_counter()
        sched.update(out, accepted)
        t3 = time.perf_counter()
        if timed:
            core_s += (t1 - t0) + (t3 - t2)
            driver_s += t2 - t1
    assert sched.num_running == n, "a request finished or was preempted during the benchmark"
    steps = args.steps
    result = {
        "benchmark": "scheduler",
        "num_seqs": n,
        "num_spec_tokens": k,
        "block_size": args.block_size,
        "steps": steps,
        "us_per_step": round(core_s / steps * 1e6, 1),
        "fake_sampler_us_per_step": round(driver_s / steps * 1e6, 1),
        "stats": {key: v for key, v in sched.stats().items() if not isinstance(v, list)},
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cpus",
    }
    if not args.json:
        print(f"{n} seqs, k={k}: {result['us_per_step']} us/step in the core")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
