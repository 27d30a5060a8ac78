"""Block manager + scheduler cost per step, with no model; and (--engine-step) one ngram decode
step through the engine with a stub forward, before and after C++ took over the request state.

Default: N running requests, k drafts each, random acceptance, prefix caching on. Times the calls a
decode step makes into the C++ core (set drafts, schedule, update); the numpy work that fakes the
sampler is timed separately. Prints one JSON line last: {"us_per_step": ...}.

--engine-step: the engine's step at R = 1, 64, 256 decode rows (tiny Llama, the forward replaced by
fixed logits), Python time and time inside the scheduler's calls per step, for the current engine
and for LegacyEngine (the previous proposal path). Writes results/scheduler_step_cpu.json.

    python benchmarks/bench_scheduler.py --num-seqs 1024 --num-spec-tokens 4 --json
    python benchmarks/bench_scheduler.py --engine-step --steps 50
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pyengine import LLM, SamplingParams, _C
from pyengine.engine.llm_engine import LLMEngine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-seqs", type=int, default=1024)
    ap.add_argument("--num-spec-tokens", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print only the JSON result")
    ap.add_argument("--engine-step", action="store_true", help="the engine's ngram decode step, before and after")
    args = ap.parse_args()
    if args.engine_step:
        engine_step_benchmark(args)
        return
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


# ---- one ngram decode step through the engine, stub forward (--engine-step) ------------------------
class TimedScheduler:
    """The C++ scheduler with the time spent inside its calls summed: the core's own cost."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.core_s, self.calls = inner, 0.0, 0

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if not callable(attr):
            self.calls += 1
            return attr

        def timed(*args: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return attr(*args, **kw)
            finally:
                self.core_s += time.perf_counter() - t0
                self.calls += 1
        return timed


class LegacyEngine(LLMEngine):
    """The previous commit's proposal path, call for call, against today's core: decode rows found
    by asking num_computed per running request, tokens left computed per request in Python, one
    dict lookup per row for the policy's statistics row, and the rows the policy shortens proposed
    again one by one from a copy of their tokens. Its requests are streamed: every step appends each
    row's tokens and text in Python, as the previous commit path did for every request."""

    def _propose(self) -> None:
        sched, reqs = self.scheduler, self.requests
        ids = [sid for sid in sched.running_ids()
               if sched.num_computed(sid) == len(reqs[sid].prompt_token_ids) + len(reqs[sid].output_token_ids) - 1]
        if not ids:
            return
        can_finish_last = None
        if not sched.num_waiting and len(ids) >= 2:
            def left(sid: int) -> tuple[int, int]:
                req = reqs[sid]
                p, done = req.params, len(req.output_token_ids)
                most = min(p.max_tokens - done, self.cfg.max_model_len - len(req.prompt_token_ids) - done)
                return most, (most if p.ignore_eos and not p.stop and not p.stop_token_ids else 1)

            bounds = {sid: left(sid) for sid in sched.running_ids()}
            fewest = max(f for _, f in bounds.values())
            can_finish_last = np.fromiter((bounds[sid][0] >= fewest for sid in ids), bool, len(ids))
        slot_of = self.__dict__.setdefault("legacy_slots", {})
        slots = np.fromiter((slot_of.setdefault(sid, len(slot_of)) for sid in ids), np.int64, len(ids))
        lengths = self.draft_length.draft_lengths(slots, np.asarray(ids), can_finish_last)
        num_drafts = int(lengths.max())
        sched.propose_ngram(self.proposer.min_n, self.proposer.max_n, np.asarray(ids),
                            np.full(len(ids), num_drafts, np.int32))
        short = [(sid, int(n)) for sid, n in zip(ids, lengths) if n < num_drafts]
        if short:
            drafts = [_C.propose_ngram(sched.token_ids(sid), self.proposer.min_n, self.proposer.max_n, n) if n else []
                      for sid, n in short]
            sched.set_draft_tokens_batch(np.fromiter((s for s, _ in short), np.int64, len(short)),
                                         np.fromiter(itertools.chain.from_iterable(drafts), np.int32),
                                         np.fromiter((len(d) for d in drafts), np.int32, len(short)))


def engine_step(rows: int, legacy: bool, steps: int, k: int, model: str) -> dict[str, float]:
    """Python and core time of one ngram decode step with `rows` decode rows; the forward is a
    stub returning fixed logits (token 5 wins everywhere, so every draft is accepted). The
    proposal part (decode rows, draft lengths, ngram lookup) is also timed on its own."""
    spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    max_len = 16 + (steps + 8) * (k + 1)
    llm = LLM(model=model, device="cpu", speculative_config=spec, max_num_seqs=rows, max_model_len=max_len,
              num_kv_blocks=rows * (-(-max_len // 16) + 1))
    engine = llm.engine
    if legacy:
        engine.__class__ = LegacyEngine
    logits = torch.full((rows * (k + 1), engine.model_config.vocab_size), -1.0)
    logits[:, 5] = 1.0
    engine.runner.execute = lambda batch: logits[:len(batch.logits_indices)]
    params = SamplingParams(temperature=0, max_tokens=max_len - 16, ignore_eos=True)
    for i in range(rows):
        engine.add_request([7 + i % 50] * 8 + [5] * 8, params, stream=legacy)
    timed = TimedScheduler(engine.scheduler)
    engine.scheduler = timed
    propose, spent = engine._propose, [0.0, 0.0]  # the proposal part: its whole time, its core time

    def timed_propose() -> None:
        t0, core0 = time.perf_counter(), timed.core_s
        propose()
        spent[0] += time.perf_counter() - t0
        spent[1] += timed.core_s - core0
    engine._propose = timed_propose
    for _ in range(3):  # prefill, then warm-up decode steps
        engine.step()
    timed.core_s, timed.calls, spent[:] = 0.0, 0, [0.0, 0.0]
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    total = time.perf_counter() - t0
    assert engine.scheduler.num_running == rows, "a request finished during the measured steps"
    return {"step_us": round(total / steps * 1e6, 1), "core_us": round(timed.core_s / steps * 1e6, 1),
            "python_us": round((total - timed.core_s) / steps * 1e6, 1),
            "propose_python_us": round((spent[0] - spent[1]) / steps * 1e6, 1),
            "propose_core_us": round(spent[1] / steps * 1e6, 1),
            "calls_per_step": round(timed.calls / steps, 1)}


def engine_step_benchmark(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests.tiny_models import make_checkpoint

    with tempfile.TemporaryDirectory() as model:
        make_checkpoint("llama_gqa_untied", model)
        results = {}
        for rows in (1, 64, 256):
            for name, legacy in (("before", True), ("after", False)):
                results.setdefault(str(rows), {})[name] = engine_step(rows, legacy, args.steps, args.num_spec_tokens,
                                                                      model)
                print(rows, name, results[str(rows)][name], flush=True)
    out = {
        "benchmark": "ngram decode step, Python side vs C++ core (stub forward, CPU)",
        "before": "LegacyEngine in this file: the previous engine's per-row Python path (decode rows found by asking each request, the room clamp in Python, shortened rows re-proposed one by one, every request's tokens and text appended each step) against today's core",
        "num_spec_tokens": args.num_spec_tokens, "steps": args.steps, "rows": results,
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cpus",
        "date": time.strftime("%Y-%m-%d %H:%M"), "command": " ".join(["python"] + sys.argv),
    }
    path = Path(__file__).resolve().parent / "results" / "scheduler_step_cpu.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
