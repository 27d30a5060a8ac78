"""The draft-length policy on graph-replayed steps (graph_costs: a step costs what its longest row
drafts, every row padded to it): it picks one draft count d for the step, the one with the best
expected tokens per second, or none; probes come in groups. runner_graph_costs adds the host
overhead of a step with drafts to the graphs' measured replays."""
from __future__ import annotations

import types

import numpy as np
import pytest

from pyengine.spec_decode.draft_length import DraftLengthPolicy
from pyengine.spec_decode.step_cost import device_rates, runner_graph_costs
from tests.test_draft_length_policy import mostly, simulate

K = 4


def policy(cost_by_d: list[float], **kw) -> DraftLengthPolicy:
    table = np.array(cost_by_d, dtype=np.float64)
    return DraftLengthPolicy(K, step_cost=(1.0, 0.01), graph_costs=lambda rows: table, **kw)


def test_flat_costs_and_good_acceptance_draft_the_full_length_on_every_row() -> None:
    # a launch-bound model: a verify step costs what a decode step does, plus the host's share
    chosen = simulate(K, rows=16, accept=0.7, cost=(1.0, 0.01), policy=policy([1.0, 1.3, 1.3, 1.3, 1.3]))
    assert mostly(chosen[-100:], K)


def test_dear_verify_steps_draft_nothing() -> None:
    # 30% acceptance cannot pay a step that costs 60% more
    chosen = simulate(K, rows=16, accept=0.3, cost=(1.0, 0.01), policy=policy([1.0, 1.6, 1.7, 1.8, 1.9]))
    assert mostly(chosen[-100:], 0)


@pytest.mark.parametrize("accept", [0.5, 0.8])
def test_the_chosen_count_is_the_best_rate(accept: float) -> None:
    """One step's choice against brute force over d, from the policy's own estimates."""
    cost = [1.0, 1.2, 1.5, 1.9, 2.4]
    p = policy(cost)
    simulate(K, rows=8, accept=accept, cost=(1.0, 0.01), policy=p, steps=60)
    rows = np.arange(8)
    est = p.acceptance(rows)
    h = p.found[rows] / p.asked[rows]
    tokens = [8 + sum(float(h @ est[:, j]) for j in range(d)) for d in range(K + 1)]
    found_any = 1 - np.prod(1 - h)
    rates = [t / (found_any * c + (1 - found_any) * cost[0]) for t, c in zip(tokens, cost)]
    best = int(np.argmax(rates))
    want = best if best and rates[best] > 1.05 * rates[0] else 0
    got = p._padded_lengths(rows, np.ones(8, dtype=bool), np.array(cost), closed=False)
    assert set(got.tolist()) == {want}
    assert 0 < want < K if accept == 0.5 else want > 0


def test_rarely_found_but_accepted_drafts_are_asked_for() -> None:
    """A proposer that finds drafts one step in ten, all accepted: asking costs a verify step only
    when it finds some, so asking pays although the expected gain per step is small."""
    chosen = simulate(K, rows=1, accept=1.0, found=0.1, cost=(1.0, 0.01), policy=policy([1.0, 1.5, 1.5, 1.5, 1.5]))
    assert mostly(chosen[-100:], K)


def test_a_closed_batch_drafts_only_where_its_last_rows_all_accept() -> None:
    """No request waits: the run lasts as long as the rows that can finish last. Sixteen such rows
    accepting 70% each almost never all accept, so no drafts; one such row accepting 70% saves the
    whole batch a step each time, so drafts."""
    p = policy([1.0, 1.4, 1.4, 1.4, 1.4])
    simulate(K, rows=16, accept=0.7, cost=(1.0, 0.01), policy=p, steps=60)
    rows, ids = np.arange(16), np.arange(16) + 100
    assert not p.draft_lengths(rows, ids, np.ones(16, dtype=bool)).any()
    one = np.arange(16) == 3
    got = p.draft_lengths(rows, ids, one)
    assert got[3] > 0 and not got[~one].any()
    assert p.draft_lengths(rows, ids, None).all(), "an open batch (requests waiting) drafts on every row"


def test_rows_that_cannot_finish_last_get_nothing() -> None:
    p = policy([1.0, 1.1, 1.1, 1.1, 1.1])
    simulate(K, rows=4, accept=0.9, cost=(1.0, 0.01), policy=p, steps=20)
    got = p.draft_lengths(np.arange(4), np.arange(4) + 100, np.array([True, False, True, False]))
    assert got[1] == got[3] == 0 and got[0] == got[2] > 0


def test_probes_come_in_groups() -> None:
    """Drafts never pay, yet the rows' next positions are probed now and then: the probes of all
    rows stale for half the interval share one step, so few steps carry drafts."""
    p = policy([1.0, 3.0, 3.0, 3.0, 3.0], probe_every=20)
    chosen = simulate(K, rows=16, accept=0.2, cost=(1.0, 0.01), policy=p, steps=400)[DraftLengthPolicy.WARMUP_STEPS:]
    probe_steps = chosen.any(axis=1)
    assert 0 < probe_steps.sum() <= 400 / 20 + 2, probe_steps.sum()
    assert chosen[probe_steps].astype(bool).sum(axis=1).mean() >= 8, "probes should be grouped"


def test_runner_graph_costs_adds_the_host_overhead_to_steps_with_drafts() -> None:
    replays = np.array([1e-3, 1.1e-3, 1.2e-3, 1.3e-3, 1.4e-3])
    measured = []
    graphs = types.SimpleNamespace(use_graphs=True, step_costs=lambda rows: replays if rows <= 64 else None,
                                   measure_step_costs=lambda: measured.append(1))
    runner = types.SimpleNamespace(graph_runner=graphs, device="cpu")
    costs = runner_graph_costs(runner, 3)
    assert measured == [1], "the replays are measured once, when the costs are made"
    overhead = device_rates("cpu").draft_overhead
    assert np.allclose(costs(16), [1e-3, 1.1e-3 + overhead, 1.2e-3 + overhead, 1.3e-3 + overhead])
    assert costs(65) is None
    assert runner_graph_costs(types.SimpleNamespace(graph_runner=None, device="cpu"), 3) is None
    no_graphs = types.SimpleNamespace(graph_runner=types.SimpleNamespace(use_graphs=False), device="cpu")
    assert runner_graph_costs(no_graphs, 3) is None


def test_the_host_overhead_of_a_step_with_drafts_grows_with_its_rows(monkeypatch) -> None:
    """A verify step's unhidden host work (verification, commit, proposing, scheduling) is paid per
    row too: with the H100's measured share, the same replays and acceptance draft at batch 1 and
    not at batch 64, where the host work outweighs the tokens gained."""
    from pyengine.spec_decode import step_cost

    h100 = step_cost.device_rates("cuda", device_name="NVIDIA H100 80GB HBM3")
    assert h100.overhead_per_row > 0
    monkeypatch.setattr(step_cost, "device_rates", lambda device: h100)
    # launch-bound replays (seconds), like SmolLM2's: q = 1 .. 5 cost about the same
    replays = {1: np.array([1.0e-3, 1.0e-3, 1.01e-3, 1.01e-3, 1.02e-3]),
               64: np.array([1.16e-3, 1.36e-3, 1.55e-3, 1.74e-3, 1.94e-3])}
    graphs = types.SimpleNamespace(use_graphs=True, step_costs=lambda rows: replays[rows], measure_step_costs=lambda: None)
    costs = runner_graph_costs(types.SimpleNamespace(graph_runner=graphs, device="cuda"), K)
    assert np.allclose(costs(64)[1:] - replays[64][1:], h100.draft_overhead + 64 * h100.overhead_per_row)
    assert np.allclose(costs(1)[1:] - replays[1][1:], h100.draft_overhead + h100.overhead_per_row)
    assert costs(1)[0] == replays[1][0] and costs(64)[0] == replays[64][0]
    one = simulate(K, rows=1, accept=0.6, cost=(1.0, 0.01), policy=DraftLengthPolicy(K, step_cost=(1.0, 0.01),
                                                                                         graph_costs=costs))
    many = simulate(K, rows=64, accept=0.6, cost=(1.0, 0.01), policy=DraftLengthPolicy(K, step_cost=(1.0, 0.01),
                                                                                         graph_costs=costs))
    assert mostly(one[-100:], K) and mostly(many[-100:], 0), (one[-100:].mean(), many[-100:].mean())


def test_steps_the_device_loop_builds_pay_its_smaller_overhead(monkeypatch) -> None:
    """A step of at most built_rows rows is built on the device from its predecessor's argmax
    (engine/device_verify.py) and costs about its replay; larger steps pay the host's work. With the
    same replays and acceptance, the policy drafts at 16 rows where the loop builds the step and
    not where the host launches it."""
    from pyengine.spec_decode import step_cost

    h100 = step_cost.device_rates("cuda", device_name="NVIDIA H100 80GB HBM3")
    assert 0 < h100.built_overhead < h100.draft_overhead
    monkeypatch.setattr(step_cost, "device_rates", lambda device: h100)
    replays = np.array([1.03e-3, 1.06e-3, 1.09e-3, 1.12e-3, 1.15e-3])  # SmolLM2-like (16, q) replays
    graphs = types.SimpleNamespace(use_graphs=True, step_costs=lambda rows: replays, measure_step_costs=lambda: None)
    runner = types.SimpleNamespace(graph_runner=graphs, device="cuda")
    built = runner_graph_costs(runner, K, built_rows=lambda: 16)
    assert np.allclose(built(16)[1:] - replays[1:], h100.built_overhead)
    assert np.allclose(built(17)[1:] - replays[1:], h100.draft_overhead + 17 * h100.overhead_per_row)
    assert built(16)[0] == replays[0]
    host = runner_graph_costs(runner, K)
    assert np.allclose(host(16)[1:] - replays[1:], h100.draft_overhead + 16 * h100.overhead_per_row)
    limit = [16]  # the loop's row limit is read when a step is planned: a loop turned off prices the host's
    follows = runner_graph_costs(runner, K, built_rows=lambda: limit[0])
    assert np.allclose(follows(16), built(16))
    limit[0] = 0
    assert np.allclose(follows(16), host(16))
    # a drafting layer (EAGLE-3, MTP): its built steps pay the launch of its forwards on the device,
    # on the host's paths its own overhead (catch-up and chain after the predecessor's tokens)
    layer = runner_graph_costs(runner, K, built_rows=lambda: 16, drafting_layer=True)
    assert np.allclose(layer(16)[1:] - replays[1:], h100.built_drafter_overhead)
    assert h100.built_overhead < h100.built_drafter_overhead < h100.drafter_overhead + 16 * h100.drafter_overhead_per_row
    assert np.allclose(layer(17)[1:] - replays[1:], h100.drafter_overhead + 17 * h100.drafter_overhead_per_row)
    assert h100.drafter_overhead + 16 * h100.drafter_overhead_per_row > h100.draft_overhead + 16 * h100.overhead_per_row
    on_device = simulate(K, rows=16, accept=0.3, cost=(1.0, 0.01),
                         policy=DraftLengthPolicy(K, step_cost=(1.0, 0.01), graph_costs=built))
    on_host = simulate(K, rows=16, accept=0.3, cost=(1.0, 0.01),
                       policy=DraftLengthPolicy(K, step_cost=(1.0, 0.01), graph_costs=host))
    assert on_device[-100:].any(axis=1).mean() >= 0.9 and mostly(on_host[-100:], 0), \
        (on_device[-100:].mean(), on_host[-100:].mean())


def test_runner_graph_costs_add_the_drafting_layers_forwards() -> None:
    """An EAGLE-3 / MTP layer on graphs: a step drafting d tokens also runs d of its forwards (a
    catch-up, d - 1 chained drafts), measured once like the replays; the policy then drafts less
    where those forwards are dear."""
    replays = np.array([1e-3, 1.05e-3, 1.1e-3, 1.15e-3, 1.2e-3])
    graphs = types.SimpleNamespace(use_graphs=True, step_costs=lambda rows: replays,
                                   measure_step_costs=lambda: None)
    runner = types.SimpleNamespace(graph_runner=graphs, device="cpu")
    measured = []
    head = types.SimpleNamespace(measure_forward_seconds=lambda: measured.append(1),
                                 forward_cost=lambda rows: 3e-4 if rows <= 8 else None)
    costs = runner_graph_costs(runner, 4, head, drafting_layer=True)
    assert measured == [1]
    rates = device_rates("cpu")
    expected = replays + np.array([0, 1, 1, 1, 1]) * rates.drafter_overhead + 3e-4 * np.arange(5)
    assert np.allclose(costs(4), expected) and costs(9) is None
    # steps the device loop builds: its launch's overhead, the forwards included
    built = runner_graph_costs(runner, 4, head, built_rows=lambda: 4, drafting_layer=True)
    assert np.allclose(built(4), replays + np.array([0, 1, 1, 1, 1]) * rates.built_drafter_overhead)
    cheap = runner_graph_costs(runner, 4, types.SimpleNamespace(measure_forward_seconds=lambda: None,
                                                                forward_cost=lambda rows: 1e-5), drafting_layer=True)
    # acceptance 0.8 a position: drafting pays with cheap forwards, not with forwards of 0.3 of a step
    with_cheap = simulate(K, rows=1, accept=0.8, cost=(1.0, 0.01),
                          policy=DraftLengthPolicy(K, step_cost=(1.0, 0.01), graph_costs=cheap))
    with_dear = simulate(K, rows=1, accept=0.8, cost=(1.0, 0.01),
                         policy=DraftLengthPolicy(K, step_cost=(1.0, 0.01), graph_costs=costs))
    assert with_dear[-100:].sum() < with_cheap[-100:].sum() / 2, (with_dear[-100:].sum(), with_cheap[-100:].sum())


def full_and_repeating_plans(graphs: bool, accept: float, found: float) -> tuple[np.ndarray, np.ndarray, list]:
    """The lengths of 300 simulated steps of 6 rows planned afresh every step, the same with plans
    repeated where _still_quiet allows, and what _still_quiet answered at each step (graph steps or
    eager ones, probes every 10 steps)."""
    def make() -> DraftLengthPolicy:
        if graphs:
            return policy([1.0, 1.5, 1.6, 1.7, 1.8], probe_every=10)
        return DraftLengthPolicy(K, step_cost=(1.0, 0.3), probe_every=10)

    full, fast, calls = make(), make(), []
    full._still_quiet = lambda *a: None
    orig = fast._still_quiet
    fast._still_quiet = lambda *a: calls.append(orig(*a)) or calls[-1]
    cost = (1.0, 0.01) if graphs else (1.0, 0.3)
    a = simulate(K, rows=6, accept=accept, cost=cost, policy=full, steps=300, found=found)
    b = simulate(K, rows=6, accept=accept, cost=cost, policy=fast, steps=300, found=found)
    return a, b, calls


@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("accept", [0.05, 0.5])
def test_quiet_spells_plan_what_a_full_plan_would(graphs: bool, accept: float) -> None:
    """The shortcut for steps after a plan without drafts (same rows, no probe due) gives the very
    lengths the full plan gives, step for step, probes included."""
    a, b, calls = full_and_repeating_plans(graphs, accept, found=1.0)
    assert np.array_equal(a, b)
    assert sum(c is not None for c in calls) > 50, "the shortcut should serve most steps of a batch that does not speculate"


def test_plans_the_proposer_cannot_fill_repeat_without_planning_afresh() -> None:
    """Eager steps, a proposer that never finds drafts (ngram on text that repeats nothing): the rows
    keep being asked (their first match is drafted at once: an unfilled draft costs nothing there),
    and the plan is repeated without planning afresh: the lengths a full plan gives, step for step,
    from far fewer full plans."""
    a, b, calls = full_and_repeating_plans(False, 0.5, found=0.0)
    assert np.array_equal(a, b)
    asked = b[DraftLengthPolicy.WARMUP_STEPS:] > 0
    assert asked.mean() > 0.9, "rows whose proposer finds nothing keep being asked"
    repeats = [c for c in calls if c is not None and c.any()]
    assert len(repeats) > 200, f"the plan should be repeated, not made afresh ({len(repeats)} of 300)"


def test_unfilled_probes_on_graph_steps_wait_an_interval() -> None:
    """Graph steps, a proposer that never finds drafts: a probe it cannot fill is not asked again at
    once (on a padded step, one row's filled probe makes the whole batch's step a verify step):
    rows are asked about once per interval, and the quiet shortcut serves the steps between."""
    a, b, calls = full_and_repeating_plans(True, 0.5, found=0.0)
    differ = (a != b).any(axis=1)
    assert differ.sum() <= 3, np.nonzero(differ)[0]
    asking = b[DraftLengthPolicy.WARMUP_STEPS:].any(axis=1)
    assert 0 < asking.sum() <= 300 / 10 + 8, asking.sum()  # + the first steps, while h falls
    assert sum(c is not None for c in calls) > 200, "steps between probes should repeat the quiet plan"


@pytest.mark.parametrize("found", [0.05, 0.2])
def test_regression_probes_of_a_large_batch_stay_one_step_per_interval(found: float) -> None:
    """Regression (Spec-Bench, SmolLM2, batch 64 on an H100): ngram filled a few rows' probes each
    step, the unfilled ones were asked again the next step, so 46 of 256 steps were padded verify
    steps for ~2.4 extra tokens each (+70% of a step's time): ngram ran at 0.86x plain. Drafts that
    never pay: steps that ask for any draft stay at about one per probe interval."""
    p = policy([1.0, 1.7, 1.75, 1.8, 1.85], probe_every=48)
    chosen = simulate(K, rows=64, accept=0.3, cost=(1.0, 0.01), policy=p, steps=480, found=found)
    asking = chosen[DraftLengthPolicy.WARMUP_STEPS:].any(axis=1)
    assert 0 < asking.sum() <= 480 / 48 + 2, asking.sum()


def test_expects_no_drafts_where_the_proposer_seldom_finds_any() -> None:
    """The engine launches the next step ahead on a plan that will most likely give no row drafts:
    none planned, or rows whose proposer has found nothing for a while, weighed by what a launch
    risks (a discarded decode replay) against what it saves (the host's work). New rows (no
    history: they may well find drafts), rows that find drafts, or a step whose replay dwarfs the
    host's work say otherwise."""
    def run(replay: float, found: bool) -> list[tuple[bool, bool]]:
        p = policy([replay, 1.5, 1.6, 1.7, 1.8], probe_every=5)
        p.launch_overhead = 0.5
        slots, ids = np.arange(4), np.arange(4) + 100
        seen = []
        for _ in range(60):
            lengths = p.draft_lengths(slots, ids)
            seen.append((bool(lengths.any()), p.expects_no_drafts()))
            drafts = lengths if found else np.zeros(4, dtype=np.int64)
            p.observe_rows(slots, drafts, drafts + 1)
        return seen

    seen = run(1.0, found=False)
    assert seen[0] == (True, False), "the warm-up's probes of new rows may find drafts"
    late = [no for drafts, no in seen[20:] if drafts]  # asked again once per interval
    assert late and all(late), "rows whose proposer finds nothing: launch ahead"
    assert all(no for drafts, no in seen if not drafts)
    late = [no for drafts, no in run(1000.0, found=False)[20:] if drafts]
    assert late and not any(late), "a replay that dwarfs the host's work is not risked"
    found = run(1.0, found=True)
    assert found[-1] == (True, False), "rows that find (and have accepted) drafts: no launch ahead"
    no_graphs = DraftLengthPolicy(K, step_cost=(1.0, 0.01))
    assert no_graphs.expects_no_drafts()
    no_graphs.draft_lengths(np.arange(2), np.arange(2))
    assert not no_graphs.expects_no_drafts(), "without graphs only a plan without drafts counts"
