"""Load time and peak memory of the default experience: LLM() on the default GGUF (SmolLM2-135M
Q4_1), then one chat answer, each run in a fresh process.

Per run: seconds for `import pyengine`, for LLM() to be ready (and how much of that the C++ packer
of the CPU GEMM took: PackedLinear's constructor and from_gguf), for the answer (16 greedy tokens), and the process's peak resident memory
(the kernel's maxrss: what `/usr/bin/time -v` reports as "Maximum resident set size"). Reports
the medians over the runs and writes results/load_cpu.json (one entry per --label).
--pythonpath runs another checkout's pyengine (an older commit extracted with `git archive`, the
extension copied in) for a before/after on the same machine.

    python benchmarks/bench_load.py --runs 5
    git archive HEAD pyengine | tar -x -C /tmp/before && cp pyengine/_C*.so /tmp/before/pyengine/
    python benchmarks/bench_load.py --runs 5 --pythonpath /tmp/before --label before
    python benchmarks/bench_load.py --runs 5 --baseline /tmp/before   # both, in alternation
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
from pyengine import LLM, SamplingParams
t1 = time.perf_counter()
packing = [0.0]
try:  # the share of the load spent in the C++ packer (PackedLinear's constructor)
    from pyengine.ops.cpu import gemm
    init = gemm.PackedLinear.__init__
    def timed(self, *args, **kwargs):
        start = time.perf_counter()
        init(self, *args, **kwargs)
        packing[0] += time.perf_counter() - start
    gemm.PackedLinear.__init__ = timed
    if hasattr(gemm.PackedLinear, "from_gguf"):  # packing straight from the GGUF blocks
        from_gguf = gemm.PackedLinear.from_gguf.__func__
        def timed_gguf(cls, *args, **kwargs):
            start = time.perf_counter()
            try:
                return from_gguf(cls, *args, **kwargs)
            finally:
                packing[0] += time.perf_counter() - start
        gemm.PackedLinear.from_gguf = classmethod(timed_gguf)
except ImportError:
    pass
t1b = time.perf_counter()
llm = LLM(model=sys.argv[1] or None)
t2 = time.perf_counter()
out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
               SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
t3 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "load_s": t2 - t1b, "pack_s": packing[0], "answer_s": t3 - t2,
                  "text": out[0].outputs[0].text}))
"""

ROOT = Path(__file__).resolve().parents[1]


def run_child(argv: list[str], stdin: bytes, env: dict[str, str], cwd: str) -> tuple[dict[str, Any], str, float]:
    """Runs `python argv` in a fresh process fed `stdin`; its last stdout line as JSON, its stderr,
    and its own peak RSS in MB (wait4: not the parent's or another child's). SystemExit if it fails."""
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen([sys.executable, *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                env=env, cwd=cwd)
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(stdin)
        proc.stdin.close()
        stdout = proc.stdout.read()  # to EOF: the child has exited
        proc.stdout.close()
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        err.seek(0)
        stderr = err.read().decode(errors="replace")
    if proc.returncode:
        raise SystemExit(f"child {argv[-1] if argv else ''} failed ({proc.returncode}):\n{stderr[-3000:]}")
    return json.loads(stdout.decode().strip().splitlines()[-1]), stderr, usage.ru_maxrss / 1024  # Linux: KiB


def run_once(model: str, pythonpath: str) -> dict[str, Any]:
    """One fresh process: its timings, peak RSS and stderr line count."""
    result, stderr, peak_rss_mb = run_child(["-c", CHILD, model], b"", dict(os.environ, PYTHONPATH=pythonpath),
                                            pythonpath)
    result["peak_rss_mb"] = peak_rss_mb
    result["stderr_lines"] = len(stderr.splitlines())
    return result


def loadavg() -> list[float] | None:
    """/proc/loadavg's three figures, rounded (None where the OS has none)."""
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None


def machine() -> dict[str, Any]:
    """The CPU (model name), its logical cores, Python and the load now: every CPU benchmark's header."""
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {"cpu": cpu, "logical_cpus": os.cpu_count(), "python": platform.python_version(),
            "loadavg_at_start": loadavg()}


def summarize(label: str, pythonpath: str, note: str, started: tuple[Any, str], runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The medians (and best load, worst RSS) of one checkout's runs, with the runs themselves."""
    return {
        "label": label,
        "command": "python benchmarks/bench_load.py " + shlex.join(sys.argv[1:]),
        "pythonpath": pythonpath,
        "note": note,
        "loadavg_at_start": started[0],
        "date": started[1],
        "load_s_median": round(statistics.median(r["load_s"] for r in runs), 3),
        "load_s_min": round(min(r["load_s"] for r in runs), 3),
        "peak_rss_mb_median": round(statistics.median(r["peak_rss_mb"] for r in runs), 1),
        "peak_rss_mb_max": round(max(r["peak_rss_mb"] for r in runs), 1),
        "pack_s_median": round(statistics.median(r["pack_s"] for r in runs), 3),
        "answer_s_median": round(statistics.median(r["answer_s"] for r in runs), 3),
        "import_s_median": round(statistics.median(r["import_s"] for r in runs), 3),
        "answer": runs[0]["text"],
        "runs": [{k: round(v, 3) if isinstance(v, float) else v for k, v in r.items() if k != "text"} for r in runs],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--model", default="", help="a GGUF or HF directory (default: the default model)")
    ap.add_argument("--pythonpath", default=str(ROOT), help="the checkout whose pyengine runs")
    ap.add_argument("--label", default="after")
    ap.add_argument("--note", default="", help="what the checkout is (stored with the result)")
    ap.add_argument("--baseline", default="", help="another checkout run in alternation with --pythonpath (a paired "
                                                   "before/after: each round runs both, the same load on both)")
    ap.add_argument("--baseline-label", default="before")
    ap.add_argument("--no-write", action="store_true", help="print the result, leave results/load_cpu.json alone")
    args = ap.parse_args()
    started = machine()["loadavg_at_start"], time.strftime("%Y-%m-%d %H:%M")
    checkouts = ([(args.baseline_label, args.baseline)] if args.baseline else []) + [(args.label, args.pythonpath)]
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label, _ in checkouts}
    for i in range(args.runs):
        for label, path in checkouts if i % 2 == 0 else checkouts[::-1]:  # neither always goes first
            r = run_once(args.model, path)
            runs[label].append(r)
            print(f"run {i + 1} {label}: load {r['load_s']:.2f} s (packing {r['pack_s']:.2f} s), answer {r['answer_s']:.2f} s,"
                  f" peak RSS {r['peak_rss_mb']:.0f} MB, import {r['import_s']:.2f} s: {r['text']!r}", flush=True)
    summaries = {label: summarize(label, path, args.note if label == args.label else f"baseline of {args.label}",
                                  started, runs[label]) for label, path in checkouts}
    for summary in summaries.values():
        print(json.dumps({k: v for k, v in summary.items() if k != "runs"}))
    if args.no_write:
        return
    out = ROOT / "benchmarks" / "results" / "load_cpu.json"
    previous = json.loads(out.read_text()) if out.exists() else {}
    result = {
        "benchmark": "LLM() on the default GGUF to ready, then one chat answer; fresh process per run",
        "model": args.model or "default (SmolLM2-135M-Instruct.Q4_1.gguf)",
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "command": "python benchmarks/bench_load.py " + shlex.join(sys.argv[1:]),
        "results": {**previous.get("results", {}), **summaries},
    }
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
