"""How many threads the CPU ops' pool (csrc/cpu/cpu_thread_pool.h) runs.

By default torch's thread count. set_pool_threads(N) pins the count; set_pool_threads("auto") caps
torch's count by the cores of this process's affinity that were free while the model loaded
(/proc/stat's busy time over that stretch, less this process's own CPU time). The cap is opt-in:
on the shared 2-core VM, under fair-share load rather than one spinning process, it chose one
thread where two decoded faster (benchmarks/results/busy_core_cpu.json). A core taken while the
pool runs is handled by the pool itself, which runs jobs on the caller alone for a while after a
job waited on a descheduled worker, or after a window of jobs where the workers ran under half
their share of the chunks (they were seldom on a core: csrc/cpu/cpu_pool_policy.h).
"""
from __future__ import annotations

import os
import resource
import sys
import time

MIN_SAMPLE_S = 0.05  # /proc/stat counts in 10 ms ticks: five of them per core at least
_CLOCK_TICK = os.sysconf("SC_CLK_TCK")


def free_cores(cpus: int, busy_cores: float) -> int:
    """Cores of `cpus` left after others' work of `busy_cores` cores, rounded; at least 1."""
    return max(1, min(cpus, int(cpus - busy_cores + 0.5)))


def choose_threads(requested: int, cpus: int, busy_cores: float | None) -> int:
    """The requested count (torch's) capped by the free cores; busy_cores None (not measured) caps
    by cpus only."""
    cap = cpus if busy_cores is None else free_cores(cpus, busy_cores)
    return max(1, min(requested, cap))


def _busy_ticks(cpus: set[int]) -> int:
    """Non-idle ticks (user, nice, system, irq, softirq, steal) of these CPUs so far."""
    total = 0
    with open("/proc/stat", encoding="ascii") as f:
        for line in f:
            name, *fields = line.split()
            if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
                user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[:8])
                total += user + nice + system + irq + softirq + steal
    return total


def _own_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class BusySampler:
    """Others' CPU use on this process's cores from construction until busy_cores() (at least
    MIN_SAMPLE_S later: it sleeps the rest). None where /proc/stat cannot be read."""

    def __init__(self) -> None:
        self.cpus = os.sched_getaffinity(0)
        try:
            self._start = (time.monotonic(), _busy_ticks(self.cpus), _own_cpu_s())
        except (OSError, ValueError):
            self._start = None

    def busy_cores(self) -> float | None:
        if self._start is None:
            return None
        t0, ticks0, own0 = self._start
        time.sleep(max(0.0, MIN_SAMPLE_S - (time.monotonic() - t0)))
        try:
            ticks = _busy_ticks(self.cpus)
        except (OSError, ValueError):
            return None
        wall = time.monotonic() - t0
        others = (ticks - ticks0) / _CLOCK_TICK - (_own_cpu_s() - own0)
        return max(0.0, others / wall)


_sampler = BusySampler()  # from import on: the model's loading covers the sample ("auto" only)
_busy: list[float | None] = []  # measured once, by the first pool_threads_for under "auto"
_told: set[int] = set()
_setting: list[int | str | None] = [None]


def set_pool_threads(value: int | str | None) -> None:
    """The pool's thread count from now on: None torch's count (the default), N >= 1 exactly N,
    "auto" torch's count capped by the cores free at the first use. ValueError otherwise."""
    if value is not None and value != "auto" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"pool threads must be None, 'auto' or a whole number >= 1, got {value!r}")
    _setting[0] = value


def pool_threads_for(requested: int) -> int:
    """The pool's thread count for torch's `requested` count under set_pool_threads' setting."""
    setting = _setting[0]
    if setting is None:
        return requested
    if setting != "auto":
        return int(setting)
    if not _busy:
        _busy.append(_sampler.busy_cores())
    cpus = len(_sampler.cpus)
    chosen = choose_threads(requested, cpus, _busy[0])
    if chosen < requested and requested not in _told:  # once: say why fewer threads run
        _told.add(requested)
        print(f"pyengine: {chosen} of {requested} CPU threads ({_busy[0]:.1f} of {cpus} cores busy elsewhere "
              "at start-up)", file=sys.stderr)
    return chosen
