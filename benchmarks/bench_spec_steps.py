"""Where a speculative run's time goes, step by step (GPU, SmolLM2 GGUF, Spec-Bench): each step of the
timed run is classed (decode or prefill rows, with or without drafts, "probe" when the draft-length
policy's own choice was none and only its probes drafted) and reported per class: steps, mean
decode rows, tokens committed, rows with drafts, wall ms (synchronised per step, so that no step's
GPU work spills into the next: plain decoding loses its launch-ahead overlap here; throughput is
bench_spec_gpu.py's) and the host parts (propose, the policy's plan, verify or sample including the
wait for the GPU, commit). Graphs are captured before a warm-up on mirrored prompts, as
bench_spec_gpu does. One JSON line per (batch, method). --device cpu runs the same accounting eagerly.

    python3 benchmarks/bench_spec_steps.py --gguf S.gguf --prompts spec_bench.jsonl --batches 16,64 > steps.jsonl
"""
from __future__ import annotations

import argparse
import collections
import json
import time
from typing import Any, Callable

import numpy as np
import torch

from pyengine import LLM, SamplingParams

PARTS = ["wall", "propose", "draft_lengths", "execute", "verify", "sample_greedy", "commit", "plan_next"]


def wrap(obj: Any, name: str, label: str, cur: dict, pre: Callable | None = None, post: Callable | None = None) -> None:
    """obj.name timed into cur[label]; pre(*args) before, post(result, *args) after."""
    f = getattr(obj, name)

    def timed(*a, **k):
        if pre:
            pre(*a, **k)
        t = time.perf_counter()
        r = f(*a, **k)
        cur[label] = cur.get(label, 0.0) + time.perf_counter() - t
        if post:
            post(r, *a, **k)
        return r

    setattr(obj, name, timed)


def run(gguf: str, device: str, batch: int, method: str, conv: list, mirror: list, params: SamplingParams) -> dict:
    spec = None if method == "plain" else {"method": method, "num_speculative_tokens": 4}
    llm = LLM(gguf, device=device, dtype="bfloat16" if device == "cuda" else "auto", max_num_seqs=batch,
              max_model_len=2048, speculative_config=spec)
    e = llm.engine
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    if e.runner.graph_runner is not None:
        e.capture_graphs()
    llm.chat(mirror, params, use_tqdm=False)
    cur: dict = {}
    steps: list[dict] = []

    def batch_info(b) -> None:
        d = np.asarray(b.num_draft_tokens)
        cur.update(decode_rows=int(b.num_decode_rows), drafts=int(d.sum()), draft_rows=int((d > 0).sum()),
                   prefill=int(b.num_rows) > int(b.num_decode_rows))

    wrap(e, "_propose", "propose", cur)
    wrap(e.runner, "execute", "execute", cur, pre=batch_info)
    wrap(e, "_commit", "commit", cur, post=lambda r, b, tokens, counts, committed, reasons:
         cur.update(committed=int(np.asarray(committed).sum())))
    wrap(e.greedy, "verify", "verify", cur)
    wrap(e, "_sample_greedy", "sample_greedy", cur)
    policy = e.draft_length
    if policy is not None:
        wrap(policy, "_padded_lengths", "padded", cur, post=lambda r, *a: cur.update(policy_d=int(np.max(r, initial=0))))
        wrap(policy, "draft_lengths", "draft_lengths", cur,
             post=lambda r, slots, *a: cur.update(probes=int((policy.probes[np.asarray(slots)] >= 0).sum())))
        wrap(e, "_plan_next", "plan_next", cur)
    step = e.step

    def timed_step():
        cur.clear()
        sync()
        t = time.perf_counter()
        r = step()
        sync()
        cur["wall"] = time.perf_counter() - t
        steps.append(dict(cur))
        return r

    e.step = timed_step
    start = time.perf_counter()
    outs = llm.chat(conv, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    classes: dict[str, list[dict]] = collections.defaultdict(list)
    for s in steps:
        c = ("prefill" if s.get("prefill") else "decode") + ("_drafts" if s.get("drafts") else "")
        if s.get("drafts") and s.get("policy_d", 1) == 0 and s.get("probes", 0):
            c += "_probe"
        classes[c].append(s)
    summary = {}
    for c, ss in sorted(classes.items()):
        summary[c] = dict(n=len(ss), rows=round(float(np.mean([s.get("decode_rows", 0) for s in ss])), 1),
                          committed=round(float(np.mean([s.get("committed", 0) for s in ss])), 2),
                          draft_rows=round(float(np.mean([s.get("draft_rows", 0) for s in ss])), 2),
                          **{k + "_ms": round(1e3 * float(np.mean([s.get(k, 0.0) for s in ss])), 3) for k in PARTS})
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return dict(batch=batch, method=method, tokens_per_s=round(tokens / seconds, 1), steps=len(steps), classes=summary)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--prompts", required=True, help="Spec-Bench jsonl (turns[0] of each line)")
    ap.add_argument("--batches", default="16,64")
    ap.add_argument("--methods", default="plain,ngram,suffix")
    ap.add_argument("--per-category", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = ap.parse_args()
    by_cat: dict[str, list[str]] = {}
    for line in open(args.prompts):
        r = json.loads(line)
        by_cat.setdefault(r["category"], []).append(r["turns"][0])
    questions = [c[i] for i in range(args.per_category) for c in by_cat.values() if i < len(c)]
    conv = [[{"role": "user", "content": q}] for q in questions]
    mirror = [[{"role": "user", "content": " ".join(q.split()[::-1])}] for q in questions]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    for batch in [int(b) for b in args.batches.split(",")]:
        for method in args.methods.split(","):
            print(json.dumps(run(args.gguf, args.device, batch, method, conv, mirror, params)), flush=True)
            if args.device == "cuda":
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
