"""Where a decode step's time goes: the host phases of an engine step (schedule, forward launch,
greedy sampling and its wait, commit), with async decode on and off (pyengine/engine.py), the step
interval against the graph replay alone (the difference is GPU idle time between forwards), and
the kernels of one CUDA-graph replay grouped by name (torch.profiler, CUPTI).

    python benchmarks/profile_decode_step.py --model llama8b --batch 1 [--gguf PATH] [--top 25]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_decode import make_llm, sync_time  # noqa: E402
from gpu_timing import time_ms  # noqa: E402

from pyengine import SamplingParams  # noqa: E402


class TimedScheduler:
    """Forwards to the C++ scheduler, timing schedule() and update()."""

    def __init__(self, inner, times: dict) -> None:
        self.inner, self.times = inner, times

    def schedule(self):
        t = time.perf_counter()
        b = self.inner.schedule()
        self.times["schedule"].append(time.perf_counter() - t)
        return b

    def update(self, tokens, counts):
        t = time.perf_counter()
        out = self.inner.update(tokens, counts)
        self.times["update (C++ commit)"].append(time.perf_counter() - t)
        return out

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def timed(obj, attr: str, label: str, times: dict) -> None:
    fn = getattr(obj, attr)

    def wrapper(*a, **k):
        t = time.perf_counter()
        out = fn(*a, **k)
        times[label].append(time.perf_counter() - t)
        return out
    setattr(obj, attr, wrapper)


def run_steps(eng, prompts, new_tokens: int, with_syncs: bool, times: dict) -> list[float]:
    """Decode-only step times: the interval between step() returns, or with a device sync before
    and after each step when with_syncs. times (the phase timers) keeps only decode steps."""
    for p in prompts:
        eng.add_request(p, SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True))
    eng.step()  # the prefill
    for k in list(times):
        times[k].clear()
    steps = []
    last = sync_time()
    while eng.has_unfinished():
        if with_syncs:
            last = sync_time()
        eng.step()
        now = sync_time() if with_syncs else time.perf_counter()
        steps.append(now - last)
        last = now
    torch.cuda.synchronize()
    return steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama8b", choices=["llama8b", "smollm2"])
    ap.add_argument("--gguf")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--max-num-seqs", type=int, default=0, help="engine max_num_seqs (default: the batch)")
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--replays", type=int, default=5)
    ap.add_argument("--cprofile", action="store_true")
    args = ap.parse_args()
    b = args.batch
    llm = make_llm(args.model, args.gguf, max(args.max_num_seqs, b, 1), 1024 + b * 16, 256, enforce_eager=False)
    vocab = llm.model_config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, vocab, (32,), generator=g).tolist() for _ in range(b)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    eng = llm.engine
    times: dict[str, list[float]] = defaultdict(list)
    eng.scheduler = TimedScheduler(eng.scheduler, times)
    timed(eng.runner, "execute", "execute (sync step: stage + launch)", times)
    timed(eng.runner.graph_runner, "launch_next", "launch_next (async: stage + launch)", times)
    timed(eng, "_sample_greedy", "sample_greedy (argmax, launch_next, WAIT for GPU)", times)
    timed(eng, "_commit", "commit (python)", times)
    runner = eng.runner.graph_runner
    graph = runner.graphs[(b, 1)][0]
    results = {}
    for label, async_on, syncs in (("sync engine, syncs around steps (old bench)", False, True),
                                   ("sync engine, step intervals", False, False),
                                   ("async engine, syncs around steps", True, True),
                                   ("async engine, step intervals", True, False)):
        eng.async_decode = async_on
        a0, d0 = eng.num_async_steps, eng.num_async_discarded
        steps = run_steps(eng, prompts, args.new_tokens, syncs, times)
        phases = {k: 1e6 * statistics.median(v) for k, v in times.items() if v}
        results[label] = (1e3 * statistics.median(steps), 1e3 * statistics.mean(steps), phases,
                          eng.num_async_steps - a0, eng.num_async_discarded - d0)
    runner.dev64[2 * runner.T:3 * runner.T].fill_(-1)  # no KV writes while replaying below
    replay_ms = time_ms(graph.replay, reps=50)
    launch = []
    for _ in range(20):  # CPU cost of launching the graph (the GPU may start before it returns)
        torch.cuda.synchronize()
        t = time.perf_counter()
        graph.replay()
        launch.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    logits = runner.graphs[(b, 1)][1][:b]
    am = []
    for _ in range(20):
        torch.cuda.synchronize()
        t = time.perf_counter()
        logits.argmax(dim=-1).cpu()
        am.append(time.perf_counter() - t)
    if args.cprofile:
        import cProfile
        import pstats
        eng.async_decode = True
        prof_host = cProfile.Profile()
        prof_host.enable()
        run_steps(eng, prompts, 32, False, defaultdict(list))
        prof_host.disable()
        pstats.Stats(prof_host).sort_stats("tottime").print_stats(15)
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
    print(f"{'us/step':>9} {'count':>6}  kernel")
    for t, n, name in rows[: args.top]:
        print(f"{t:9.1f} {n:6.0f}  {name[:110]}")
    print(f"{args.model} batch {b} (max_num_seqs {max(args.max_num_seqs, b)}): graph replay {replay_ms:.3f} ms, "
          f"kernel time {busy_us / 1e3:.3f} ms in {kernels:.0f} kernels (gaps {replay_ms - busy_us / 1e3:.3f} ms); "
          f"graph.replay() CPU call {1e6 * statistics.median(launch):.0f} us; "
          f"argmax + .cpu() on an idle GPU {1e6 * statistics.median(am):.0f} us")
    for label, (med, mean, phases, n_async, n_disc) in results.items():
        print(f"{label}: step median {med:.3f} ms (mean {mean:.3f}), over graph {1e3 * (med - replay_ms):.0f} us; "
              f"async steps {n_async}, discarded {n_disc}")
        for k, v in phases.items():
            print(f"    {k}: {v:.0f} us")


if __name__ == "__main__":
    main()
