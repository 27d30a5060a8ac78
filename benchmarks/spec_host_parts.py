"""Where a step's host time goes: wall-clock timers around the engine's step parts (schedule,
execute, the greedy sampler's start / accept and its wait for the GPU, propose, the draft-length
policy, commit, ...), per step kind (with drafts or not; with prefill rows or not), in microseconds
per step. SmolLM2 on CUDA graphs, Spec-Bench first turns interleaved by category, greedy. A
diagnostic: the timers themselves cost a little; compare parts, not totals, across runs.

    python3 benchmarks/spec_host_parts.py --gguf S.gguf --prompts spec_bench.jsonl --batch 16 --method suffix
"""
import argparse
import collections
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.bench_spec_gpu import spec_bench_rows  # noqa: E402
from pyengine import LLM, SamplingParams  # noqa: E402


class TimedScheduler:
    """The engine's scheduler with every method call timed as "sched.<name>"."""

    def __init__(self, scheduler, timed) -> None:
        object.__setattr__(self, "_scheduler", scheduler)
        object.__setattr__(self, "_timed", timed)

    def __getattr__(self, name: str):
        attr = getattr(self._scheduler, name)
        return self._timed("sched." + name, attr) if callable(attr) else attr


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--prompts", required=True, help="Spec-Bench jsonl (turns[0] of each line)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--method", default="suffix", choices=["plain", "ngram", "suffix", "eagle3"], help="k = 4, adaptive")
    ap.add_argument("--eagle3", help="the EAGLE-3 head directory (method eagle3; default: the shipped head)")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--category", default="", help="only these Spec-Bench categories (comma-separated)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (the parts timed are those of CUDA-graph steps)")
    categories = [c for c in args.category.split(",") if c]
    interleaved = spec_bench_rows(args.prompts, per_category=1 << 30, categories=categories)  # categories interleaved
    if not interleaved:
        ap.error(f"no Spec-Bench prompts in categories {categories}")
    questions = [r["turns"][0] for r in interleaved[:max(args.batch, args.num_prompts)]]
    spec = None if args.method == "plain" else {"method": args.method, "num_speculative_tokens": 4}
    if args.method == "eagle3":
        spec["model"] = args.eagle3 or os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                    "pyengine", "heads", "smollm2-135m-instruct-eagle3")
    llm = LLM(args.gguf, device="cuda", dtype="bfloat16", max_num_seqs=args.batch, max_model_len=2048,
              speculative_config=spec)
    llm.engine.capture_graphs()
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    # warm-up on the questions with their words reversed (same lengths, nothing a cache could reuse)
    llm.chat([[{"role": "user", "content": " ".join(q.split()[::-1])}] for q in questions], params, use_tqdm=False)

    eng, step_parts = llm.engine, {}

    def timed(name: str, f):
        def wrapper(*a, **kw):
            start = time.perf_counter()
            out = f(*a, **kw)
            step_parts[name] = step_parts.get(name, 0.0) + time.perf_counter() - start
            return out
        return wrapper

    eng.scheduler = TimedScheduler(eng.scheduler, timed)
    g = eng.runner.graph_runner
    for name in ("bucket_for", "_stage", "_run", "launch_next", "launch_verify"):
        setattr(g, name, timed("graphs." + name, getattr(g, name)))
    for name in ("start", "accept"):
        setattr(eng.greedy, name, timed("greedy." + name, getattr(eng.greedy, name)))
    event_sync = torch.cuda.Event.synchronize
    torch.cuda.Event.synchronize = lambda event: timed("WAIT for the GPU", event_sync)(event)
    execute = timed("runner.execute", eng.runner.execute)

    def execute_noting_prefill(batch, *a, **kw):
        if int(batch.num_decode_rows) != len(batch.context_lens):
            step_parts["has prefill rows"] = 0.0
        return execute(batch, *a, **kw)

    eng.runner.execute = execute_noting_prefill
    eng.outputs.process = timed("outputs.process", eng.outputs.process)
    for name in ("_propose", "_commit", "_verify_greedy", "_sample_greedy", "_plan_next", "_launch_verify",
                 "_may_launch_next", "_launch_committed"):
        setattr(eng, name, timed("engine." + name, getattr(eng, name)))
    if eng.proposer is not None:
        eng.proposer.propose = timed("proposer.propose", eng.proposer.propose)
    if getattr(eng.proposer, "ring", None) is not None:  # a drafting layer (MTP, EAGLE-3)
        head = eng.proposer
        for name in ("_forward", "_catch_up_hidden", "_chain_steps"):
            setattr(head, name, timed("layer." + name, getattr(head, name)))
        head.ring.keep = timed("layer.ring.keep", head.ring.keep)
        if head.graphs is not None:
            head.graphs.run = timed("layer.graphs.run", head.graphs.run)
            key_for = head.graphs.key_for

            def key_for_noting_eager(feed):
                key = key_for(feed)
                if key is None:  # the layer's forward runs eagerly: counted (a count, not seconds)
                    step_parts["layer eager forwards (count)"] = step_parts.get("layer eager forwards (count)", 0) + 1e-6
                return key

            head.graphs.key_for = key_for_noting_eager
        if head.chain is not None:
            head.chain.run = timed("layer.chain.run", head.chain.run)
    loop = eng.device_verify
    if loop is not None:  # the device loop's launch and the host's read of it
        for name in ("launch", "resolve"):
            setattr(loop, name, timed("loop." + name, getattr(loop, name)))
        loop.kernel = timed("loop.kernel", loop.kernel)
        if loop.layer is not None:  # a drafting layer's part of the launch
            for name in ("prepare", "draft"):
                setattr(loop.layer, name, timed("loop.layer." + name, getattr(loop.layer, name)))
            head = loop.layer.proposer
            head.catch_up_held = timed("layer.catch_up_held", head.catch_up_held)
            if head.chain is not None:
                head.chain.run_from_state = timed("layer.chain.run_from_state", head.chain.run_from_state)
    if eng.draft_length is not None:
        for name in ("draft_lengths", "observe_rows"):
            setattr(eng.draft_length, name, timed("policy." + name, getattr(eng.draft_length, name)))
    if eng.verify_ahead is not None:
        eng.verify_ahead.launch = timed("verify_ahead.launch", eng.verify_ahead.launch)
        eng.verify_ahead.launch_committed = timed("verify_ahead.launch_committed", eng.verify_ahead.launch_committed)
    kinds: dict = collections.defaultdict(lambda: [0, 0.0, collections.defaultdict(float)])
    step = eng.step

    def timed_step():
        step_parts.clear()
        start = time.perf_counter()
        out = step()
        kind = "drafts" if "greedy.accept" in step_parts else "no drafts"
        kind = kinds[kind + (" + prefill" if "has prefill rows" in step_parts else "")]
        kind[0] += 1
        kind[1] += time.perf_counter() - start
        for name, seconds in step_parts.items():
            kind[2][name] += seconds
        return out

    eng.step = timed_step
    torch.cuda.synchronize()
    start = time.perf_counter()
    outs = llm.chat([[{"role": "user", "content": q}] for q in questions], params, use_tqdm=False)
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    print(f"{args.method} batch {args.batch}: {sum(len(o.outputs[0].token_ids) for o in outs) / wall:.0f} tok/s")
    for kind, (n, seconds, parts) in kinds.items():
        print(f"  {kind}: {n} steps, {1e6 * seconds / n:.0f} us/step")
        for name, part in sorted(parts.items(), key=lambda x: -x[1]):
            if name == "has prefill rows":  # a marker, not a part
                continue
            print(f"    {name:32s} {1e6 * part / n:7.2f} per step" if name.endswith("(count)") else
                  f"    {name:32s} {1e6 * part / n:7.0f}")


if __name__ == "__main__":
    main()
