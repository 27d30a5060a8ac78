"""Serving benchmark: a bounded load against pyengine's OpenAI-compatible server.

Starts `python -m pyengine.serve` on 127.0.0.1 (or uses --url), sends --num-requests chat
requests (Spec-Bench questions, "turns"[0]) as a Poisson process at --request-rate requests/s,
each streamed at temperature 0 with max_tokens fixed (ignore_eos, so every request produces the
same number of tokens), and reports request and output-token throughput, TTFT, TPOT (per request:
(end - first token) / (tokens - 1)) and end-to-end latency percentiles, plus the server's draft
acceptance from /metrics. With --spec ... the server speculates.

    python benchmarks/bench_serve.py --num-requests 40 --max-tokens 64 --request-rate 2 [--spec ngram] [--json out.json]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import socket
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA = ROOT.parent / "shared" / "data" / "spec_bench_questions.jsonl"


def load_prompts(path: Path, n: int) -> list[str]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    prompts = [r["turns"][0] for r in rows]
    return [prompts[i % len(prompts)] for i in range(n)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: argparse.Namespace, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "pyengine.serve", "--host", "127.0.0.1", "--port", str(port), "--device", args.device]
    if args.model:
        cmd += ["--model", args.model]
    if args.spec:
        cmd += ["--spec", args.spec, "--num-spec-tokens", str(args.num_spec_tokens)]
        if args.draft_model:
            cmd += ["--draft-model", args.draft_model]
    proc = subprocess.Popen(cmd, cwd=ROOT)
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with code {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit("the server did not start in 300 s")


async def one_request(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> dict:
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first = None
    tokens = 0
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            return {"error": f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif first is None and any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                first = time.perf_counter()
    end = time.perf_counter()
    out = {"ttft": (first or end) - start, "e2e": end - start, "tokens": tokens}
    out["tpot"] = (end - (first or end)) / (tokens - 1) if tokens > 1 else None
    return out


async def run_load(url: str, prompts: list[str], rate: float, max_tokens: int, seed: int) -> tuple[list[dict], float]:
    rng = random.Random(seed)
    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=1000)) as client:
        tasks = []
        start = time.perf_counter()
        for p in prompts:
            tasks.append(asyncio.create_task(one_request(client, url, p, max_tokens)))
            if rate > 0:
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start


def pct(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    a = np.asarray(values) * 1000.0
    return {"mean_ms": float(a.mean()), "p50_ms": float(np.percentile(a, 50)), "p90_ms": float(np.percentile(a, 90)),
            "p99_ms": float(np.percentile(a, 99))}


def scrape(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#") and "_bucket" not in line:
            name, value = line.rsplit(" ", 1)
            out[name.split("{")[0].removeprefix("pyengine:")] = float(value)
    return out


def cpu_name() -> str:
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", help="a running server (default: start one)")
    p.add_argument("--model")
    p.add_argument("--device", default="auto")
    p.add_argument("--spec", choices=["ngram", "draft"])
    p.add_argument("--num-spec-tokens", type=int, default=4)
    p.add_argument("--draft-model")
    p.add_argument("--data", default=str(DEFAULT_DATA))
    p.add_argument("--num-requests", type=int, default=40)
    p.add_argument("--request-rate", type=float, default=2.0, help="requests/s (Poisson); 0: all at once")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="append this run's result to a JSON file (a list)")
    args = p.parse_args()
    prompts = load_prompts(Path(args.data), args.num_requests)
    proc = None
    url = args.url
    if url is None:
        port = free_port()
        proc = start_server(args, port)
        url = f"http://127.0.0.1:{port}"
    try:
        results, wall = asyncio.run(run_load(url, prompts, args.request_rate, args.max_tokens, args.seed))
        server = scrape(url)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=60)
    ok = [r for r in results if "error" not in r]
    tokens = sum(r["tokens"] for r in ok)
    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name] + sys.argv),
        "device": cpu_name() if args.device != "cuda" else "cuda",
        "spec": args.spec, "num_spec_tokens": args.num_spec_tokens if args.spec else 0,
        "num_requests": len(results), "num_failed": len(results) - len(ok), "request_rate": args.request_rate,
        "max_tokens": args.max_tokens, "wall_s": wall,
        "request_throughput": len(ok) / wall, "output_token_throughput": tokens / wall,
        "ttft": pct([r["ttft"] for r in ok]), "tpot": pct([r["tpot"] for r in ok if r["tpot"] is not None]),
        "e2e": pct([r["e2e"] for r in ok]),
        "acceptance_rate": server.get("spec_decode_draft_acceptance_rate"),
        "mean_acceptance_length": server.get("spec_decode_mean_acceptance_length"),
        "num_preemptions": server.get("num_preemptions_total"),
    }
    print(json.dumps(result, indent=1))
    if args.json:
        path = Path(args.json)
        runs = json.loads(path.read_text()) if path.exists() else []
        path.write_text(json.dumps(runs + [result], indent=1) + "\n")


if __name__ == "__main__":
    main()
