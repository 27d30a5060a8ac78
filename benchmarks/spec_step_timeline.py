"""Host timeline of speculative steps with a fixed draft count (every step drafts), GPU: for each
part of a step (propose and its pieces, the verify's staging and launch, the wait for its tokens,
commit), the median offset from the step's start and its median duration, from host timestamps
only (no synchronisation added). Shows how long the host works before the verify forward can be
launched. EAGLE-3 with the shipped head by default (--head), MTP-free targets only.

    python3 benchmarks/spec_step_timeline.py --gguf S.gguf --prompts spec_bench.jsonl --k 4
"""
from __future__ import annotations

import argparse
import collections
import json
import time
from typing import Any

import numpy as np
import torch

from pyengine import LLM, SamplingParams


def timed(obj: Any, name: str, label: str, events: list) -> None:
    """obj.name records (label, start, end) into events on every call."""
    f = getattr(obj, name)

    def wrapper(*a, **kw):
        t = time.perf_counter()
        r = f(*a, **kw)
        events.append((label, t, time.perf_counter()))
        return r

    setattr(obj, name, wrapper)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--prompts", required=True, help="Spec-Bench jsonl (turns[0] of each line)")
    ap.add_argument("--head", default="pyengine/heads/smollm2-135m-instruct-eagle3")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--num-prompts", type=int, default=26)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: eager steps (a smoke test)")
    args = ap.parse_args()
    questions = [json.loads(line)["turns"][0] for line in open(args.prompts)]
    prompts = questions[::max(1, len(questions) // args.num_prompts)][:args.num_prompts]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    spec = {"method": "eagle3", "model": args.head, "num_speculative_tokens": args.k, "adaptive_draft_length": False}
    llm = LLM(args.gguf, device=args.device, dtype="bfloat16" if args.device == "cuda" else "auto", max_num_seqs=1,
              max_model_len=2048, speculative_config=spec)
    e, p = llm.engine, llm.engine.proposer
    if e.runner.graph_runner is not None:
        e.capture_graphs()
    llm.chat([[{"role": "user", "content": q}] for q in prompts[:8]], params, use_tqdm=False)  # warm-up, captures
    events: list = []
    parts = [(e, "_step", "step"), (e, "_propose", "propose"), (p, "_catch_up_hidden", "catch_up_hidden"),
             (p, "_forward", "head forward (catch-up; chain steps off the graph)"), (p.sampler, "draw", "draw"), (p.device_drafts, "hold", "hold"),
             (p.device_drafts, "patch_for", "patch_for"), (e.runner, "execute", "execute (verify staged, launched)"),
             (p.device_drafts, "resolve", "resolve"), (e.greedy, "verify", "verify (waits for the GPU)"),
             (e, "_commit", "commit")]
    if p.chain is not None:
        parts.append((p.chain, "run", "chain.run"))
    for obj, name, label in parts:
        timed(obj, name, label, events)
    llm.chat([[{"role": "user", "content": q}] for q in prompts], params, use_tqdm=False)
    steps = [ev for ev in events if ev[0] == "step"]
    starts, ends = np.array([s[1] for s in steps]), np.array([s[2] for s in steps])
    offset, duration = collections.defaultdict(list), collections.defaultdict(list)
    for label, a, b in events:
        i = np.searchsorted(starts, a, side="right") - 1
        if label != "step" and i >= 0 and a <= ends[i]:
            offset[label].append((a - starts[i]) * 1e6)
            duration[label].append((b - a) * 1e6)
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(json.dumps({"device": device, "k": args.k, "steps": len(steps),
                      "step_ms_median": round(float(np.median(ends - starts)) * 1e3, 3)}))
    for label in sorted(offset, key=lambda lab: np.median(offset[lab])):
        print(f"  {label:34s} calls/step {len(offset[label]) / len(steps):4.2f}  starts {np.median(offset[label]):6.0f} us"
              f"  lasts {np.median(duration[label]):6.0f} us")


if __name__ == "__main__":
    main()
