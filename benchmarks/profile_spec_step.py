"""Where a step's time goes in greedy decoding on the GPU (SmolLM2, Spec-Bench prompts), plain or
speculative: per phase of LLMEngine.step (propose, schedule, forward with a device sync after it,
sampling / verification, update, commit), total ms and ms per step, by step kind (with or
without drafts, with or without prefill rows); with --cprofile also the top functions by own time.
--num-prompts runs more prompts than --batch through continuous batching.

    python3 benchmarks/profile_spec_step.py --gguf PATH --prompts spec_bench.jsonl --batch 64 --method ngram
"""
from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import time
from collections import defaultdict

import torch

from pyengine import LLM, SamplingParams


def instrument(llm: LLM) -> dict:
    """Wrap the engine's phases; returns {step kind: {phase: [calls, seconds]}}, filled as the LLM
    runs. Step kinds: "decode" (no row drafts), "verify" (some row verifies drafts), each with
    "+prefill" when a prefill row shares the step."""
    engine, phases = llm.engine, defaultdict(lambda: defaultdict(lambda: [0, 0.0]))
    current: dict = defaultdict(lambda: [0, 0.0])

    def timed(obj, name: str, label: str, sync: bool = False) -> None:
        fn = getattr(obj, name)

        def wrapper(*a, **kw):
            start = time.perf_counter()
            out = fn(*a, **kw)
            if sync and torch.cuda.is_available():
                torch.cuda.synchronize()
            current[label][0] += 1
            current[label][1] += time.perf_counter() - start
            return out

        setattr(obj, name, wrapper)

    timed(engine, "_propose", "propose")
    timed(engine.runner, "execute", "forward (synced)", sync=True)
    timed(engine, "_sample", "sample: general")
    timed(engine.greedy, "verify", "sample: greedy verify")
    timed(engine, "_sample_greedy", "sample: greedy argmax")
    timed(engine, "_commit", "commit")
    sched = engine.scheduler
    inner_step = engine.step

    def step():
        verify0, prefill0 = sched.stats()["num_verify_rows"], engine.counters["prefill_tokens"]
        current.clear()
        start = time.perf_counter()
        out = inner_step()
        current["step (all)"] = [1, time.perf_counter() - start]
        kind = "verify" if sched.stats()["num_verify_rows"] > verify0 else "decode"
        kind += "+prefill" if engine.counters["prefill_tokens"] > prefill0 else ""
        for label, (calls, seconds) in current.items():
            phases[kind][label][0] += calls
            phases[kind][label][1] += seconds
        return out

    engine.step = step

    class Sched:  # the C++ scheduler's schedule / update, timed
        def __getattr__(self, name):
            return getattr(sched, name)

        def schedule(self):
            start = time.perf_counter()
            out = sched.schedule()
            current["schedule"][0] += 1
            current["schedule"][1] += time.perf_counter() - start
            return out

        def update(self, *a):
            start = time.perf_counter()
            out = sched.update(*a)
            current["update"][0] += 1
            current["update"][1] += time.perf_counter() - start
            return out

    engine.scheduler = Sched()
    return phases


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--method", default="ngram", help="ngram, suffix, or none (plain)")
    ap.add_argument("--fixed", action="store_true", help="no adaptive draft length")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--cprofile", action="store_true")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--num-prompts", type=int, help="prompts to run through max_num_seqs = --batch "
                    "(continuous batching; default: one wave of --batch prompts)")
    args = ap.parse_args()
    with open(args.prompts) as f:
        questions = [json.loads(line)["turns"][0] for line in f if line.strip()]
    spec = None if args.method == "none" else {"method": args.method, "num_speculative_tokens": 4,
                                               "adaptive_draft_length": not args.fixed}
    cuda = args.device == "cuda"
    llm = LLM(args.gguf, device=args.device, dtype="bfloat16" if cuda else "auto", max_num_seqs=args.batch, max_model_len=2048,
              speculative_config=spec)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    conv = [[{"role": "user", "content": q}] for q in questions]
    timed_conv = conv[:args.num_prompts or args.batch]
    spare = conv[len(timed_conv):] or conv  # warm-up (graphs captured) on other prompts: suffix decoding must
    llm.chat([spare[i % len(spare)] for i in range(args.batch)], params, use_tqdm=False)  # not cache the timed answers
    phases = instrument(llm)
    prof = cProfile.Profile() if args.cprofile else None
    steps0 = llm.stats()["num_steps"]
    g = llm.engine.runner.graph_runner
    graphs0 = len(g.graphs) if g is not None else 0
    start = time.perf_counter()
    if prof:
        prof.enable()
    llm.chat(timed_conv, params, use_tqdm=False)
    if prof:
        prof.disable()
    seconds = time.perf_counter() - start
    st = llm.stats()
    steps = st["num_steps"] - steps0
    print(json.dumps({"method": args.method, "batch": args.batch, "prompts": len(timed_conv), "fixed": args.fixed,
                      "steps": steps, "seconds": round(seconds, 3), "acceptance_rate": st.get("acceptance_rate"),
                      "graphs_captured_while_timed": (len(g.graphs) if g is not None else 0) - graphs0,
                      "phases_ms_by_step_kind": {
                          kind: {k: {"calls": c, "ms": round(1e3 * t, 1),
                                     "ms_per_step": round(1e3 * t / by_phase["step (all)"][0], 3)}
                                 for k, (c, t) in sorted(by_phase.items())}
                          for kind, by_phase in sorted(phases.items())}}))
    if prof:
        p = pstats.Stats(prof)
        p.sort_stats("tottime").print_stats(22)


if __name__ == "__main__":
    main()
