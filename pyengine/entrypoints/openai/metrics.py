"""GET /metrics: the Prometheus text format (version 0.0.4), written by hand (no dependency).

Per-request figures (time to first token, time per output token, end-to-end latency, finish
reasons) are recorded when a request ends (AsyncLLM.on_finish, on the engine's loop thread); the
engine's counters and the KV cache's use are read at scrape time (AsyncLLM.stats(), between steps).
"""
from __future__ import annotations

import bisect
import threading
from typing import Any

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                2.5)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)
PREFIX = "pyengine:"


class Histogram:
    def __init__(self, name: str, help_: str, buckets: tuple[float, ...]) -> None:
        self.name, self.help, self.buckets = name, help_, buckets
        self.counts = [0] * (len(buckets) + 1)  # the last: above every bound (+Inf only)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def lines(self, labels: str) -> list[str]:
        name = PREFIX + self.name
        out = [f"# HELP {name} {self.help}", f"# TYPE {name} histogram"]
        cumulative = 0
        for bound, c in zip(self.buckets, self.counts):
            cumulative += c
            out.append(f'{name}_bucket{{{labels},le="{bound}"}} {cumulative}')
        out.append(f'{name}_bucket{{{labels},le="+Inf"}} {self.count}')
        out += [f"{name}_sum{{{labels}}} {self.sum}", f"{name}_count{{{labels}}} {self.count}"]
        return out


class ServerMetrics:
    """What /metrics reports for one served model."""

    def __init__(self, model_name: str) -> None:
        self.labels = f'model_name="{_escape(model_name)}"'
        self._lock = threading.Lock()
        self.ttft = Histogram("time_to_first_token_seconds", "Time from arrival to the first output token.",
                              TTFT_BUCKETS)
        self.tpot = Histogram("time_per_output_token_seconds", "Time per output token after the first.",
                              TPOT_BUCKETS)
        self.e2e = Histogram("e2e_request_latency_seconds", "Time from arrival to the end of a request.", E2E_BUCKETS)
        self.finished: dict[str, int] = {}
        self.num_received = 0
        self.num_bad = 0

    def request_received(self) -> None:
        with self._lock:
            self.num_received += 1

    def request_refused(self) -> None:
        with self._lock:
            self.num_bad += 1

    def request_finished(self, info: dict[str, Any]) -> None:
        with self._lock:
            reason = info["finish_reason"] or "unknown"
            self.finished[reason] = self.finished.get(reason, 0) + 1
            if info["ttft"] is not None:
                self.ttft.observe(info["ttft"])
            if info["tpot"] is not None:
                self.tpot.observe(info["tpot"])
            self.e2e.observe(info["e2e"])

    def render(self, stats: dict[str, Any]) -> str:
        """The text exposition, with the engine's stats (AsyncLLM.stats())."""
        L = self.labels
        lines: list[str] = []

        def metric(name: str, kind: str, help_: str, value: float, labels: str = L) -> None:
            full = PREFIX + name
            lines.extend([f"# HELP {full} {help_}", f"# TYPE {full} {kind}", f"{full}{{{labels}}} {value}"])

        with self._lock:
            metric("http_requests_received_total", "counter", "Generation requests received (HTTP).",
                   self.num_received)
            metric("http_requests_refused_total", "counter", "Generation requests refused as bad input (HTTP 4xx).",
                   self.num_bad)
            full = PREFIX + "request_success_total"
            lines += [f"# HELP {full} Requests that ended, by finish reason.", f"# TYPE {full} counter"]
            for reason in sorted(set(self.finished) | {"stop", "length", "abort"}):
                lines.append(f'{full}{{{L},finished_reason="{reason}"}} {self.finished.get(reason, 0)}')
            for h in (self.ttft, self.tpot, self.e2e):
                lines += h.lines(L)
        metric("num_requests_running", "gauge", "Requests in the running batch.", stats["num_running"])
        metric("num_requests_waiting", "gauge", "Requests waiting for admission.", stats["num_waiting"])
        metric("prompt_tokens_total", "counter", "Prompt tokens of admitted requests.", stats["prompt_tokens"])
        metric("generation_tokens_total", "counter", "Generated (output) tokens.", stats["generated_tokens"])
        metric("num_preemptions_total", "counter", "Requests preempted (recomputed later).", stats["num_preemptions"])
        metric("prefix_cache_hit_tokens_total", "counter", "Prompt tokens served from the prefix cache.",
               stats["prefix_cache_hit_tokens"])
        metric("num_steps_total", "counter", "Engine steps.", stats["num_steps"])
        metric("kv_cache_usage_perc", "gauge", "Fraction of KV-cache blocks in use (1 = full).", stats["kv_cache_usage"])
        metric("kv_cache_free_blocks", "gauge", "Free KV-cache blocks.", stats["num_free_kv_blocks"])
        metric("kv_cache_total_blocks", "gauge", "KV-cache blocks in all.", stats["num_kv_blocks"])
        if "num_draft_tokens" in stats:
            metric("spec_decode_num_draft_tokens_total", "counter", "Draft tokens proposed.", stats["num_draft_tokens"])
            metric("spec_decode_num_accepted_tokens_total", "counter", "Draft tokens accepted.",
                   stats["num_accepted_tokens"])
            metric("spec_decode_draft_acceptance_rate", "gauge", "Accepted / proposed draft tokens.",
                   stats["acceptance_rate"])
            metric("spec_decode_mean_acceptance_length", "gauge", "Tokens committed per verify row.",
                   stats["mean_acceptance_length"])
        return "\n".join(lines) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
