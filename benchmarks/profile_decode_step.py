"""Where a captured decode step's GPU time goes: kernels of one CUDA-graph replay grouped by name
(torch.profiler, CUPTI), their sum against the replay's wall time (the difference is launch gaps and
tails between kernels), and the whole engine step (host work included).

    python benchmarks/profile_decode_step.py --model llama8b --batch 1 [--gguf PATH] [--top 25]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_decode import make_llm, sync_time  # noqa: E402
from gpu_timing import time_ms  # noqa: E402

from pyengine import SamplingParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama8b", choices=["llama8b", "smollm2"])
    ap.add_argument("--gguf")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--replays", type=int, default=5)
    args = ap.parse_args()
    b = args.batch
    llm = make_llm(args.model, args.gguf, max(b, 1), 1024 + b * 16, 256, enforce_eager=False)
    vocab = llm.model_config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, vocab, (32,), generator=g).tolist() for _ in range(b)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    eng = llm.engine
    # whole engine steps (host included), decode only, with the host phases timed: execute returns
    # once the graph is launched; sample waits for the GPU, then copies the tokens back
    phases: dict[str, list[float]] = {"execute (host)": [], "sample (waits for GPU)": [], "commit": []}
    for obj, attr, label in ((eng.runner, "execute", "execute (host)"), (eng, "_sample", "sample (waits for GPU)"),
                             (eng, "_commit", "commit")):
        def timed(*a, _fn=getattr(obj, attr), _label=label, **k):
            t = time.perf_counter()
            out = _fn(*a, **k)
            phases[_label].append(time.perf_counter() - t)
            return out
        setattr(obj, attr, timed)
    for p in prompts:
        eng.add_request(p, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    steps, keep = [], []
    while eng.has_unfinished():
        before = eng.counters["prefill_tokens"]
        t0 = sync_time()
        eng.step()
        dt = sync_time() - t0
        keep.append(eng.counters["prefill_tokens"] == before)
        if keep[-1]:
            steps.append(dt)
    # where the host time of a step goes (cProfile inflates Python time; read the shares)
    import cProfile
    import pstats
    for p in prompts:
        eng.add_request(p, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    eng.step()  # the prefill
    prof_host = cProfile.Profile()
    prof_host.enable()
    while eng.has_unfinished():
        eng.step()
    prof_host.disable()
    pstats.Stats(prof_host).sort_stats("tottime").print_stats(18)
    runner = eng.runner.graph_runner
    runner.dev64[2 * runner.T:3 * runner.T].fill_(-1)  # no KV writes while replaying below
    graph = runner.graphs[(b, 1)][0]
    replay_ms = time_ms(graph.replay, reps=50)
    launch = []
    for _ in range(20):  # CPU cost of launching the graph (the GPU may start before it returns)
        torch.cuda.synchronize()
        t = time.perf_counter()
        graph.replay()
        launch.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(args.replays):
            graph.replay()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
        if t > 0:
            rows.append((t / args.replays, e.count / args.replays, e.key))
    rows.sort(reverse=True)
    kernels = sum(r[1] for r in rows)
    busy_us = sum(r[0] for r in rows)
    print(f"{args.model} batch {b}: engine step median {1e3 * statistics.median(steps):.3f} ms, "
          f"graph replay {replay_ms:.3f} ms, kernel time {busy_us / 1e3:.3f} ms in {kernels:.0f} kernels "
          f"(gaps {replay_ms - busy_us / 1e3:.3f} ms)")
    for label, times in phases.items():
        kept = [t for t, k in zip(times, keep) if k] if len(times) == len(keep) else times
        print(f"  host phase {label}: median {1e6 * statistics.median(kept):.0f} us")
    print(f"  graph.replay() CPU call: median {1e6 * statistics.median(launch):.0f} us")
    print(f"{'us/step':>9} {'count':>6}  kernel")
    for t, n, name in rows[: args.top]:
        print(f"{t:9.1f} {n:6.0f}  {name[:110]}")


if __name__ == "__main__":
    main()
