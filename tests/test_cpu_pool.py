"""The CPU ops' pool under a busy core (issue 24): the thread count chosen from the cores free, the
policy that runs jobs on the caller alone for a while (after a stall, or a window where the workers
ran under half their share of the chunks), and that none of it changes a result."""
from __future__ import annotations

import pytest
import torch

from pyengine.ops import cpu as cpu_ops
from pyengine.ops.cpu import threads as cpu_threads
from pyengine.ops.cpu.extension import DTYPE_CODE

kernels = cpu_ops.kernels
Backoff = kernels.SoloBackoff


@pytest.mark.parametrize("cpus,busy,want", [(2, 0.0, 2), (2, 0.3, 2), (2, 0.6, 1), (2, 1.0, 1), (2, 2.0, 1),
                                            (8, 2.6, 5), (4, 0.0, 4), (1, 0.9, 1)])
def test_free_cores_rounds_others_load_and_keeps_one(cpus: int, busy: float, want: int) -> None:
    assert cpu_threads.free_cores(cpus, busy) == want


def test_choose_threads_caps_the_request_by_free_cores() -> None:
    assert cpu_threads.choose_threads(2, 2, 1.0) == 1  # a spinning process on one of two cores
    assert cpu_threads.choose_threads(2, 2, 0.1) == 2
    assert cpu_threads.choose_threads(1, 8, 0.0) == 1  # never more than torch's count
    assert cpu_threads.choose_threads(8, 2, None) == 2  # load unknown: the affinity's cores


def test_pool_threads_follow_the_setting() -> None:
    try:
        assert cpu_threads.pool_threads_for(2) == 2  # default: torch's count, no load sampling
        cpu_threads.set_pool_threads(3)
        assert cpu_threads.pool_threads_for(1) == 3
        cpu_threads.set_pool_threads("auto")
        assert 1 <= cpu_threads.pool_threads_for(2) <= 2
        for bad in (0, -1, "two", 1.5, True):
            with pytest.raises(ValueError, match="pool threads"):
                cpu_threads.set_pool_threads(bad)
    finally:
        cpu_threads.set_pool_threads(None)


def test_busy_sampler_measures_a_non_negative_load() -> None:
    busy = cpu_threads.BusySampler().busy_cores()
    assert busy is None or busy >= 0.0


def test_stall_is_a_wait_beyond_the_callers_own_share() -> None:
    slack = Backoff.STALL_SLACK_US
    assert not Backoff.stalled(50, 50 + slack)
    assert Backoff.stalled(50, 51 + slack)
    assert not Backoff.stalled(5000, 4000)  # a long job's last chunk in progress is no stall


def test_backoff_doubles_per_stall_and_resets_after_a_clean_stretch() -> None:
    b = Backoff()
    assert b.parallel(0)
    b.on_parallel_job(1000, False)
    assert b.parallel(1001) and b.solo_us == Backoff.MIN_SOLO_US
    t = 2000
    for k in range(12):  # a core that stays busy: each probe stalls, the quiet period grows to the cap
        period = min(Backoff.MIN_SOLO_US << k, Backoff.MAX_SOLO_US)
        b.on_parallel_job(t, True)
        assert not b.parallel(t + period - 1) and b.parallel(t + period)
        t += period
    assert b.solo_us == Backoff.MAX_SOLO_US
    b.on_parallel_job(t, False)  # the core is free again: clean jobs for CLEAN_US restore the short period
    b.on_parallel_job(t + Backoff.CLEAN_US - 1, False)
    assert b.solo_us == Backoff.MAX_SOLO_US
    b.on_parallel_job(t + Backoff.CLEAN_US, False)
    assert b.solo_us == Backoff.MIN_SOLO_US
    b.on_parallel_job(t + Backoff.CLEAN_US + 1, True)
    assert b.solo_us == 2 * Backoff.MIN_SOLO_US


@pytest.mark.parametrize("threads,chunks,worker_chunks,absent", [
    (2, 100, 24, True), (2, 100, 25, False), (2, 64, 0, True), (2, 64, 32, False),
    (3, 99, 32, True), (3, 99, 33, False), (4, 100, 37, True), (4, 100, 38, False)])
def test_workers_are_absent_under_half_their_fair_share(threads: int, chunks: int, worker_chunks: int,
                                                         absent: bool) -> None:
    assert Backoff(threads).absent(chunks, worker_chunks) == absent
    b = Backoff(threads)
    b.set_absent_fraction(0.0)  # stalls only
    assert not b.absent(chunks, 0)


def test_a_window_of_absent_workers_starts_a_quiet_period() -> None:
    window = Backoff.WINDOW_JOBS
    b = Backoff(2)
    t = 0
    for _ in range(window):  # the workers ran their share: no quiet period
        t += 10
        b.on_parallel_job(t, False, 8, 4)
        assert b.parallel(t + 1)
    for _ in range(window - 1):  # absent, but the window is not over yet
        t += 10
        b.on_parallel_job(t, False, 8, 0)
        assert b.parallel(t + 1)
    t += 10
    b.on_parallel_job(t, False, 8, 0)
    assert not b.parallel(t + 1) and b.parallel(t + Backoff.MIN_SOLO_US)
    assert b.solo_us == 2 * Backoff.MIN_SOLO_US and b.solo_periods == 1
    t += Backoff.MIN_SOLO_US
    for _ in range(window):  # the probe after it: a window of its own, absent again -> twice as long
        t += 10
        b.on_parallel_job(t, False, 8, 1)
    assert not b.parallel(t + 2 * Backoff.MIN_SOLO_US - 1) and b.parallel(t + 2 * Backoff.MIN_SOLO_US)
    assert b.solo_periods == 2


@pytest.mark.parametrize("adaptive", [False, True])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_pool_runs_every_chunk_exactly_once(threads: int, adaptive: bool, restore_pool) -> None:
    kernels.set_num_threads(threads)
    kernels.set_pool_adaptive(adaptive)
    for n in (1, 2, 3, 17, 200):
        counts, used = kernels.pool_run_counts(n, 20)
        assert counts == [1] * n, f"n = {n}"
        assert 1 <= used <= threads
    stats = kernels.pool_stats()
    if threads > 1 and not adaptive:
        assert stats["solo_jobs"] == 0 and stats["parallel_jobs"] >= 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemm_bits_do_not_depend_on_threads_or_the_stall_policy(dtype: torch.dtype, restore_pool) -> None:
    if not kernels.has_gemm(DTYPE_CODE[dtype]):
        pytest.skip("no packed GEMM on this CPU")
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(576, 200, generator=gen).to(dtype)
    x = torch.randn(33, 576, generator=gen).to(dtype)
    layer = cpu_ops.PackedLinear(w)
    torch.set_num_threads(1)  # as inside an engine step: the pool splits the work
    kernels.set_num_threads(1)
    want = layer(x, None)
    for threads in (2, 3):
        for adaptive, fraction in ((False, 0.5), (True, 0.0), (True, 0.5), (True, 1.0)):
            kernels.set_num_threads(threads)
            kernels.set_pool_adaptive(adaptive)
            kernels.set_pool_absent_fraction(fraction)  # 1.0: nearly every window counts the workers absent
            for _ in range(3):
                for m in (1, 2, 33):
                    assert torch.equal(layer(x[:m], None), want[:m]), f"{threads} threads, {adaptive} {fraction}, M {m}"


def test_silu_and_mul_bits_do_not_depend_on_threads(restore_pool) -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(9, 2 * 1536, generator=gen)  # 9 x 1536 outputs: over the pool's threshold
    want = torch.empty(9, 1536)
    kernels.set_num_threads(1)
    kernels.silu_and_mul(x.data_ptr(), want.data_ptr(), 9, 1536, DTYPE_CODE[torch.float32], True)
    for threads in (2, 3):
        kernels.set_num_threads(threads)
        got = torch.empty(9, 1536)
        kernels.silu_and_mul(x.data_ptr(), got.data_ptr(), 9, 1536, DTYPE_CODE[torch.float32], True)
        assert torch.equal(got, want), f"{threads} threads"
