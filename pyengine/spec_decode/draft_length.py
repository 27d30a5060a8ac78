"""The draft-length policy: how many drafts each decode request proposes this step, and the
step-cost model it weighs them with (a deterministic function of the model and the device)."""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from pyengine import _C
from pyengine.spec_decode.step_cost import (DEFAULT_STEP_COST, GraphCosts, StepCost, check_step_cost,
                                            device_rates, drafter_cost_share, runner_graph_costs,
                                            runner_step_cost)

# (slots, seq ids, can_finish_last, the step from which a new probe may be due, lengths): a plan to repeat
Plan = tuple[np.ndarray, np.ndarray, "np.ndarray | None", float, np.ndarray]


class DraftLengthPolicy:
    """How many drafts each request proposes this step: the lengths with the best expected goodput.

        goodput = (R + sum_i h_i sum_{j<k_i} P_ij) / T(R + sum_i h_i k_i)

    R decode rows; row i asks for k_i drafts and the proposer finds some with chance h_i; P_ij is
    the chance that drafts 0..j of row i are all accepted; T(n) = a + b n the cost of a decode step
    that feeds n tokens (shared by all rows): `step_cost`, fixed when the policy is built, by the
    user (SpeculativeConfig.step_cost) or by the cost model (for_runner: the model's weights and
    the device's rates, see modelled_step_cost). No clock is read: the lengths are a function of
    the rows, their acceptance counters and (a, b), the same in every run. Only b / a matters.

    Lengths are chosen greedily: the next draft goes to the row whose next position has the
    highest P_ij, as long as its expected tokens per extra time beat the goodput so far by
    `margin` (P_ij / b > (1 + margin) * goodput; h_i cancels out of that test). P_ij falls as j
    grows and the goodput only rises, so the first draft that fails ends the search. Where verify
    tokens cost real compute (large batches) only rows that nearly always accept keep drafts; a
    row whose recent drafts were rejected gets none while grounded rows keep speculating.

    Estimates: P_ij = c_i0 * ... * c_ij, with c_il the chance that draft l is accepted once drafts
    0..l-1 were: the row's decayed counts of trials and acceptances at position l, shrunk towards
    the batch's pooled estimate with the weight of `prior_weight` trials (a new row starts at the
    batch's estimate). A row's counts decay each time it verifies drafts, at every position: the
    positions past its current length fade back to the batch's estimate, so a row that accepts
    well is offered longer drafts again. A row that gets no drafts keeps its evidence; a row whose
    next position has gone unverified for `probe_every` steps (longer in large batches: about k
    probe drafts per `probe_every` steps over the batch) gets a probe there, and an accepted probe
    wipes the row's evidence from that position on (its acceptance has changed). On eager steps a
    probe the proposer cannot fill costs nothing and is repeated next step. A plan whose drafts the proposer
    found none of (or that has none) is repeated as it is, without planning afresh, until the rows
    change, a draft is found or another row's probe falls due (_still_quiet).

    Rows that cannot finish last get no drafts: with no request waiting for admission the batch
    only shrinks, so a token that a row commits early does not shorten the run unless that row is
    the last to finish; it only spares that row's own verify token b later, which the draft cost
    already, so a draft there pays only if it is always accepted. The engine knows which rows can
    still be last (a row's most remaining tokens >= another's fewest, see LLMEngine); where it
    cannot tell (a request may stop at EOS or a stop string any time) every row can.

    Steps replayed from CUDA graphs (graph_costs: rows -> a step's cost by its most drafts d = 0..k)
    pad every row to the longest, so a draft costs nothing once the step's d is chosen and the
    choice is d alone: the d with the best expected tokens per second, (R + sum_i h_i sum_{j<d} P_ij)
    / (f cost[d] + (1 - f) cost[0]) with f = 1 - prod_i (1 - h_i) the chance that some row's
    proposer finds drafts (else the step is a decode step), every eligible row drafting d, and none
    (d = 0, the next step launched ahead) unless that beats d = 0 by `margin`. Where no request
    waits (can_finish_last given), a draft position counts only if every row that can finish last
    accepts it: a closed batch runs as long as its longest request, padded steps included. Probes
    come in groups there, since one filled probe makes the whole step a padded verify step: at most
    one probe step per interval (unless the step drafts anyway), in which every row unverified for
    half the interval probes, and a probe the proposer cannot fill waits an interval.
    """

    WARMUP_STEPS = 4  # first steps: probes on a few rows only (the batch's estimate starts optimistic)

    def __init__(self, k: int, probe_every: int = 48, decay: float = 0.95, margin: float = 0.05,
                 prior_weight: float = 1.0, *, step_cost: StepCost | None = None,
                 graph_costs: GraphCosts | None = None, drafter_cost: float = 0.0) -> None:
        # margin: speculate only for an expected gain above it; the model omits the proposal and
        # verification overheads, so near break-even plain decoding is the safer choice
        self.k, self.probe_every, self.decay, self.margin = k, probe_every, decay, margin
        self.prior_weight = prior_weight
        # (a, b): T(n) = a + b n; None: DEFAULT_STEP_COST (for_runner gives the modelled one)
        self.step_cost = DEFAULT_STEP_COST if step_cost is None else check_step_cost(step_cost)
        self.graph_costs = graph_costs  # rows -> cost by most drafts 0..k (graph-replayed steps), or None
        # a forward of a drafting model or layer, as a share of a's (0: ngram, suffix); eager steps
        # pay one for the catch-up and one per chained draft depth (_best_lengths)
        self.drafter_cost = float(drafter_cost)
        # Batch-wide decayed counts per position; start optimistic (c = 1 with one trial's weight).
        self.pool_trials, self.pool_accepts = np.ones(k), np.ones(k)
        # Per-request statistics live in row `request slot` (the scheduler's dense index) of these
        # arrays; owner says whose they are, so a slot taken by a new request starts afresh.
        self.owner = np.zeros(0, dtype=np.int64)
        self.trials = np.zeros((0, k))  # decayed count: draft j verified after drafts 0..j-1 were accepted
        self.accepts = np.zeros((0, k))  # ... and accepted
        self.asked = np.zeros(0)  # decayed count: steps the row was asked for drafts
        self.found = np.zeros(0)  # ... in which the proposer found at least one
        self.idle = np.zeros((0, k), dtype=np.int64)  # steps since position j was last verified
        self.planned = np.zeros(0, dtype=np.int64)  # this step's lengths
        self.probes = np.zeros(0, dtype=np.int64)  # this step's probes: first probed position, -1: none
        self.fit_sums = [0.0] * 5  # opt-in calibration (observe_step): decayed sums of 1, n, t, n*n, n*t
        self.steps = 0
        # a plan to repeat (_still_quiet): one without drafts, or one whose drafts the proposer found none of
        self._quiet: Plan | None = None
        self._unfilled: Plan | None = None  # the last plan, with drafts, until its step is observed
        self._planned_any = False  # the last plan gave some row drafts
        self._plan_rows = np.zeros(0, dtype=np.int64)  # the slots the last plan was for
        # seconds of host work a step launched ahead hides (expects_no_drafts); for_runner sets it
        self.launch_overhead = 0.0
        self.last_probe_step = -probe_every  # graph steps: the last step that probed (at most one per interval)

    @classmethod
    def for_runner(cls, k: int, runner: Any, step_cost: StepCost | None = None, drafter: Any = None,
                   drafter_graphs: Any = None, built_rows: Callable[[], int] | None = None,
                   **kw: Any) -> "DraftLengthPolicy":
        """The policy for a ModelRunner's steps: step_cost if given (SpeculativeConfig.step_cost),
        else the cost model's for its model and device (runner_step_cost); a runner that replays
        CUDA graphs also gives the graphs' measured costs (runner_graph_costs, with the drafting
        layer's forwards on drafter_graphs; built_rows: the most rows of a step the device loop
        builds, read when a step is planned), unless step_cost was given."""
        graph_costs = runner_graph_costs(runner, k, drafter_graphs, built_rows, drafting_layer=drafter is not None) \
            if step_cost is None else None
        modelled = runner_step_cost(runner)
        policy = cls(k, step_cost=step_cost if step_cost is not None else modelled, graph_costs=graph_costs,
                     drafter_cost=drafter_cost_share(drafter, runner, modelled[0]), **kw)
        if graph_costs is not None:
            policy.launch_overhead = device_rates(runner.device).overhead
        return policy

    # ---- the plan ------------------------------------------------------------------------------
    def draft_lengths(self, slots: np.ndarray, seq_ids: np.ndarray,
                      can_finish_last: np.ndarray | None = None) -> np.ndarray:
        """Drafts to propose for each running decode request (0..k, one per row of the scheduler's
        decode view: request slots and seq ids). can_finish_last: one bool per request (None: all
        True); a False row gets none (see the class docstring)."""
        rows = np.asarray(slots, dtype=np.int64)
        num_rows = len(rows)
        self._unfilled = None
        repeat = self._still_quiet(rows, seq_ids, can_finish_last)
        if repeat is not None:  # planned and probes stay as the plan left them
            self.steps += 1
            self.idle[rows] += 1
            return repeat
        self._claim(rows, np.asarray(seq_ids, dtype=np.int64))
        self.planned[:] = 0
        self.probes[:] = -1
        self._planned_any = False
        self._plan_rows = rows
        if not num_rows:
            return np.zeros(0, dtype=np.int32)
        self.steps += 1
        self.idle[rows] += 1
        eligible = np.ones(num_rows, dtype=bool) if can_finish_last is None else np.asarray(can_finish_last, dtype=bool)
        # Probes (and the warm-up) stay cheap where verify tokens cost compute: about k extra
        # tokens per step whatever the batch size.
        probe = max(1, min(self.k, round(self.k / num_rows)))
        if self.steps <= self.WARMUP_STEPS:  # the batch's first evidence, from probes
            # ... on about k drafts' worth of rows: a draft model must first catch up on each
            # probed row's whole context, which a poor draft should not cost the whole batch.
            probed = np.arange(num_rows) < max(1, self.k // probe)
            lengths = np.where(eligible & probed, probe, 0)
        else:
            table = self.graph_costs(num_rows) if self.graph_costs is not None else None
            if table is None:
                lengths = self._best_lengths(rows, eligible, *self.cost_line())
                interval = self.probe_every * max(1.0, num_rows / self.k)
            else:
                lengths = self._padded_lengths(rows, eligible, table, closed=can_finish_last is not None)
                interval = float(self.probe_every)
            due = self._schedule_probes(rows, eligible, lengths, interval, table is not None, probe)
            last = None if can_finish_last is None else np.array(can_finish_last, dtype=bool)
            plan = (rows.copy(), np.array(seq_ids, dtype=np.int64), last, due, lengths.astype(np.int32))
            if lengths.any():
                self._unfilled = plan
            else:
                self._quiet = plan
        self.planned[rows] = lengths
        self._planned_any = bool(lengths.any())
        return lengths.astype(np.int32)

    def expects_no_drafts(self) -> bool:
        """The last plan will most likely give no row drafts, so that the engine may launch the
        next step ahead (graph-replayed steps only): it asks for none, or its rows' proposers have
        found drafts so rarely of late that a launched step is worth its risk. A row that finds
        drafts discards the launched forward (its cost, F: the replay of a decode step); one that
        does not hides the host's work (H, launch_overhead) behind it: launch while the chance P
        that some row finds drafts keeps (1 - P) H > P F."""
        if not self._planned_any:
            return True
        table = self.graph_costs(len(self._plan_rows)) if self.graph_costs is not None else None
        if table is None or self.launch_overhead <= 0.0:
            return False
        rows = self._plan_rows[self.planned[self._plan_rows] > 0]
        p_found = 1.0 - float(np.prod(1.0 - self.found[rows] / self.asked[rows]))
        return p_found * (self.launch_overhead + float(table[0])) < self.launch_overhead

    def _still_quiet(self, rows: np.ndarray, seq_ids: np.ndarray, can_finish_last: np.ndarray | None) -> np.ndarray | None:
        """The lengths of the last full plan again, if it is to be repeated: it was for these same
        rows, with the same rows able to finish last, no new probe is due yet, and it drafted
        nothing, or the proposer found none of its drafts. Such a step changes no estimate but the
        idle counts (which the probe deadline accounts for) and the rows' chance of finding
        drafts, so the same plan, near enough, follows; repeating it saves the plan's cost on the
        host in the long runs where speculation does not pay or finds nothing. None: plan afresh."""
        quiet, self._quiet = self._quiet, None
        if quiet is None or self.steps + 1 >= quiet[3]:
            return None
        if (can_finish_last is None) != (quiet[2] is None) or (
                quiet[2] is not None and not np.array_equal(can_finish_last, quiet[2])):
            return None
        if not (np.array_equal(rows, quiet[0]) and np.array_equal(seq_ids, quiet[1])):
            return None
        self._quiet = quiet
        return quiet[4]

    def _schedule_probes(self, rows: np.ndarray, eligible: np.ndarray, lengths: np.ndarray, interval: float,
                         graph_steps: bool, probe: int) -> float:
        """The next position of a row left unverified for `interval` steps gets a probe there (and
        beyond: lengths and probes updated in place); returns the step from which the plan stops
        repeating, when another row's next position goes stale (the plan repeats at once if it
        drafts nothing, else once the proposer has found none of its drafts: observe_rows). With
        graphs a probe makes the whole batch's step a padded verify step: at most one probe step per
        interval, in which every row unverified for half the interval probes, unless the step
        drafts anyway (then the probes ride along). One C++ pass (csrc/core/draft_policy.h)."""
        due, self.last_probe_step = _C.schedule_probes(
            self._arrays(), rows, eligible, lengths, interval, graph_steps, self.steps, self.last_probe_step,
            self.probe_every, probe)
        return due

    def _padded_lengths(self, rows: np.ndarray, eligible: np.ndarray, cost: np.ndarray, closed: bool) -> np.ndarray:
        """Graph steps: every eligible row drafts the d with the best expected tokens per second
        (cost[d]: a step whose longest row drafts d), or none (see the class docstring; one C++ pass,
        csrc/core/draft_policy.h). closed: no request waits, so the run ends when the eligible rows
        (those that can finish last) all have: a step is saved only when every one of them accepts,
        and a saved step is worth all R rows' tokens."""
        return _C.padded_draft_lengths(self._arrays(), rows, eligible, np.asarray(cost, dtype=np.float64),
                                       closed, self.margin, self.prior_weight)

    def _best_lengths(self, rows: np.ndarray, eligible: np.ndarray, a: float, b: float) -> np.ndarray:
        """Greedy marginal allocation of drafts over the eligible rows (see the class docstring).
        Only b / a matters: scaling both scales `seconds` and `b` alike in the test below. With a
        drafting model (drafter_cost), whose forwards every row reaching a depth shares, the
        allocation is made under each cap D on the depth and the D with the best goodput wins."""
        p = self.acceptance(rows) * eligible[:, None]  # [R, k], non-increasing along k
        h = self.found[rows] / self.asked[rows]
        if not self.drafter_cost:
            return self._greedy_lengths(p, h, a, b)
        num_rows = len(rows)
        best, best_rate = np.zeros(num_rows, dtype=np.int64), (1.0 + self.margin) * num_rows / (a + b * num_rows)
        for cap in range(1, self.k + 1):
            lengths = self._greedy_lengths(np.where(np.arange(self.k) < cap, p, 0.0), h, a, b)
            depth = int(lengths.max(initial=0))
            if not depth:
                continue
            taken = np.arange(self.k)[None, :] < lengths[:, None]
            tokens = num_rows + float((h[:, None] * p * taken).sum())
            # a forward for the catch-up (draft 1) and one per further depth
            seconds = a + b * (num_rows + float((h * lengths).sum())) + self.drafter_cost * a * depth
            if tokens / seconds > best_rate:
                best, best_rate = lengths, tokens / seconds
        return best

    def _greedy_lengths(self, p: np.ndarray, h: np.ndarray, a: float, b: float) -> np.ndarray:
        num_rows, k = p.shape
        # Candidates (row, position) by falling P; ties keep position order within a row, so the
        # drafts taken for a row are always a prefix.
        order = np.argsort(-p.ravel(), kind="stable")
        p_next = p.ravel()[order]
        row = order // k
        gain, cost = h[row] * p_next, b * h[row]
        tokens = num_rows + np.concatenate(([0.0], np.cumsum(gain)[:-1]))  # expected tokens before each
        seconds = a + b * num_rows + np.concatenate(([0.0], np.cumsum(cost)[:-1]))
        pays = (p_next > 0) & (p_next * seconds > (1.0 + self.margin) * b * tokens)
        taken = len(pays) if pays.all() else int(np.argmin(pays))
        return np.bincount(row[:taken], minlength=num_rows)

    def acceptance(self, rows: np.ndarray) -> np.ndarray:
        """P_ij for the given slots: [len(rows), k], non-increasing along j."""
        prior = (self.pool_accepts + 1e-12) / (self.pool_trials + 1e-12)
        w = self.prior_weight
        c = (self.accepts[rows] + w * prior) / (self.trials[rows] + w)
        return np.cumprod(c, axis=1)

    def row_acceptance(self, slot: int) -> np.ndarray:
        """P_j of the request in one slot (for tests and debugging)."""
        return self.acceptance(np.array([slot]))[0]

    # ---- observations ----------------------------------------------------------------------------
    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """Opt-in calibration, never called by the engine (which reads no clock for the policy): a
        sample (tokens fed, cost) of a decode step, e.g. from an offline benchmark. Once the samples
        span two token counts, the least-squares line through them (recent ones weigh more)
        replaces step_cost; lengths are then a function of the samples given, in order."""
        for i, v in enumerate((1.0, num_tokens, seconds, num_tokens * num_tokens, num_tokens * seconds)):
            self.fit_sums[i] = self.decay * self.fit_sums[i] + v
        self._quiet = self._unfilled = None  # the cost line moved

    def observe_rows(self, slots: np.ndarray, num_drafts: np.ndarray, num_committed: np.ndarray) -> None:
        """The decode rows of a step (request slots): drafts verified and tokens committed per row
        (rows this step's plan asked nothing of are ignored). The counts are updated in one C++
        pass (csrc/core/draft_policy.h): for each row asked, asked += 1 (decayed); an unfilled probe
        on graph steps waits an interval; with no drafts found anywhere only `found` decays; else
        `found` counts the rows with drafts, an accepted probe wipes the row's evidence from its
        position on, and each row with drafts decays its trials / accepts at every position and adds
        this step's (position j tried once drafts 0..j-1 were accepted, passed if accepted), as do
        the batch's pooled counts, and its verified positions are no longer idle."""
        if not self._planned_any:  # the plan asked nothing of any row
            return
        asked_any, drafts_any, unfilled_probes = _C.observe_draft_rows(
            self._arrays(), np.asarray(slots, dtype=np.int64), num_drafts, num_committed, self.decay,
            self.graph_costs is not None)
        if not asked_any:
            return
        if not drafts_any:  # nothing was found: no evidence but that
            # graph steps: an unfilled probe is not repeated at once (another row's filled probe would
            # make the next step a padded verify step too)
            repeat = self._unfilled if self.graph_costs is None or not unfilled_probes else None
            self._quiet, self._unfilled = repeat or self._quiet, None
            return
        self._quiet = self._unfilled = None

    # ---- internals -------------------------------------------------------------------------------
    def _arrays(self) -> tuple[np.ndarray, ...]:
        """The arrays the C++ passes read and update in place (csrc/core/bindings.cpp, PolicyArrays)."""
        return (self.trials, self.accepts, self.asked, self.found, self.idle, self.probes, self.planned,
                self.pool_trials, self.pool_accepts)

    def _claim(self, slots: np.ndarray, seq_ids: np.ndarray) -> None:
        """Rows for these slots; a slot whose request changed starts at the batch's estimate."""
        need = int(slots.max(initial=-1)) + 1
        if need > len(self.owner):
            grow = max(need, 2 * len(self.owner), 8) - len(self.owner)
            self.owner = np.concatenate([self.owner, np.full(grow, -1, dtype=np.int64)])
            self.trials = np.concatenate([self.trials, np.zeros((grow, self.k))])
            self.accepts = np.concatenate([self.accepts, np.zeros((grow, self.k))])
            self.asked = np.concatenate([self.asked, np.ones(grow)])
            self.found = np.concatenate([self.found, np.ones(grow)])
            self.idle = np.concatenate([self.idle, np.zeros((grow, self.k), dtype=np.int64)])
            self.planned = np.concatenate([self.planned, np.zeros(grow, dtype=np.int64)])
            self.probes = np.concatenate([self.probes, np.full(grow, -1, dtype=np.int64)])
        new = slots[self.owner[slots] != seq_ids]
        if len(new):
            self.trials[new] = self.accepts[new] = 0.0  # no evidence of its own: the batch's estimate
            self.asked[new] = self.found[new] = 1.0
            self.idle[new] = 0
            self.owner[slots] = seq_ids

    def cost_line(self) -> StepCost:
        """(a, b) the plan uses: the calibration samples' line where observe_step was fed two token
        counts, else step_cost."""
        return self._fitted_line() or self.step_cost

    def _fitted_line(self) -> StepCost | None:
        s1, sn, st, snn, snt = self.fit_sums
        var = s1 * snn - sn * sn
        if var <= 1e-9 * max(snn * s1, 1.0):  # fewer than two token counts
            return None
        b = max((s1 * snt - sn * st) / var, 0.0)
        a = max((st - b * sn) / s1, 1e-9)
        return a, b
