"""The draft-length policy: how many drafts each decode request proposes this step, and the
step-cost model it weighs them with (a deterministic function of the model and the device)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

StepCost = tuple[float, float]  # (a, b): a decode step that feeds n tokens costs a + b n (seconds)
# Only b / a matters to the policy. Without a model to derive it from: a bandwidth-bound step, a token
# fed costing 1% of the step's fixed cost.
DEFAULT_STEP_COST: StepCost = (1.0, 0.01)


def check_step_cost(value: Any, name: str = "step_cost") -> StepCost:
    """(a, b) as floats: a > 0 the fixed cost of a decode step, b >= 0 the cost of each token it
    feeds (any unit: only b / a matters). ValueError otherwise."""
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise ValueError(f"{name} must be a pair (a, b): a decode step feeding n tokens costs a + b * n, "
                         f"got {value!r}")
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        raise ValueError(f"{name} must hold two numbers, got {value!r}")
    a, b = float(value[0]), float(value[1])
    if not (math.isfinite(a) and math.isfinite(b) and a > 0.0 and b >= 0.0):
        raise ValueError(f"{name} needs a finite a > 0 (the step's fixed cost) and a finite b >= 0 (the cost of "
                         f"each token fed), got {value!r}")
    return a, b


@dataclass(frozen=True)
class DeviceRates:
    """Sustained rates of a device class: rough constants (about 80% of peak memory bandwidth and
    65% of dense peak FLOP/s), never measured."""
    bandwidth: float  # bytes/s: streaming the weights
    flops_16: float  # FLOP/s: fp16/bf16 matmuls
    flops_32: float  # FLOP/s: fp32 matmuls (no TF32)
    overhead: float  # seconds a step costs besides its forward (host work, launches)


# CUDA devices by name (first match, case-insensitive, in torch.cuda.get_device_name), others the
# default: rates below an H100's balance, so that verify tokens look dearer there, not cheaper.
CUDA_DEVICES: tuple[tuple[str, DeviceRates], ...] = (
    ("H200", DeviceRates(3.9e12, 6.4e14, 4.4e13, 5e-4)),  # GH200 too
    ("H100 PCIe", DeviceRates(1.6e12, 4.9e14, 3.3e13, 5e-4)),
    ("H100 NVL", DeviceRates(3.1e12, 5.4e14, 3.9e13, 5e-4)),
    ("H100", DeviceRates(2.7e12, 6.4e14, 4.4e13, 5e-4)),  # SXM
)
CUDA_DEFAULT = DeviceRates(1.0e12, 1.0e14, 1.5e13, 5e-4)
# CPUs: per core (torch's thread count), by torch's SIMD capability; bandwidth saturates at a socket's.
CPU_BANDWIDTH_PER_CORE, CPU_BANDWIDTH_MAX = 8e9, 1.2e11
CPU_FLOPS_PER_CORE = {"AVX512": 9.6e10, "AVX2": 4.8e10}  # fp32 FMA units; bf16 is counted as fp32
CPU_FLOPS_PER_CORE_DEFAULT = 1.6e10
CPU_OVERHEAD = 1e-3


def device_rates(device: torch.device | str, device_name: str | None = None, cpu_cores: int | None = None,
                 cpu_capability: str | None = None) -> DeviceRates:
    """The rates of a device: CUDA by name (None: torch.cuda.get_device_name), CPU by cores (None:
    torch.get_num_threads()) and SIMD capability (None: torch.backends.cpu.get_cpu_capability())."""
    device = torch.device(device)
    if device.type == "cuda":
        name = (device_name if device_name is not None else torch.cuda.get_device_name(device)).lower()
        return next((rates for key, rates in CUDA_DEVICES if key.lower() in name), CUDA_DEFAULT)
    if device.type != "cpu":
        return CUDA_DEFAULT
    cores = max(1, cpu_cores if cpu_cores is not None else torch.get_num_threads())
    capability = cpu_capability if cpu_capability is not None else torch.backends.cpu.get_cpu_capability()
    per_core = next((f for key, f in CPU_FLOPS_PER_CORE.items() if capability.upper().startswith(key)),
                    CPU_FLOPS_PER_CORE_DEFAULT)
    return DeviceRates(min(cores * CPU_BANDWIDTH_PER_CORE, CPU_BANDWIDTH_MAX), cores * per_core, cores * per_core,
                       CPU_OVERHEAD)


def modelled_step_cost(num_params: int, weight_bytes: int, device: torch.device | str, dtype: torch.dtype,
                       **device_kw: Any) -> StepCost:
    """(a, b) of a decode step on this device (device_kw: device_rates' overrides):
        a = weight_bytes / bandwidth + overhead   streaming the weights once, and the host's work
        b = 2 num_params / FLOP/s                 the matmuls of one more token fed
    A sum, not the roofline's max: a token is charged its FLOPs even where they would hide under the
    weight stream, which errs towards fewer drafts. Attention is left out (its KV reads and FLOPs grow
    with the context, not with the weights)."""
    rates = device_rates(device, **device_kw)
    flops = rates.flops_32 if dtype == torch.float32 else rates.flops_16
    return weight_bytes / rates.bandwidth + rates.overhead, 2.0 * num_params / flops


VOCAB_TABLES = ("embed_tokens", "lm_head", "packed_lm_head")  # pyengine's models' names for them


def weight_footprint(model: torch.nn.Module) -> tuple[int, int]:
    """(matmul parameters, bytes) of the weights a step streams: each weight of two or more dims
    that the model's modules hold, once (Parameters and plain attributes: dense or oneDNN-prepacked
    tensors, pyengine's PackedLinear at its packed size); of the vocabulary tables (VOCAB_TABLES)
    only the smallest, the lm_head the logits read (the input embedding is only gathered from)."""
    seen: set[int] = set()
    weights: list[tuple[int, int]] = []
    vocab: list[tuple[int, int]] = []
    for module in model.modules():
        for name, value in [*module._parameters.items(), *vars(module).items()]:
            if value is None or id(value) in seen:
                continue
            seen.add(id(value))
            if isinstance(value, torch.Tensor):
                if value.dim() < 2 or value.numel() == 0:
                    continue
                numel, size = value.numel(), value.numel() * value.element_size()
            elif all(hasattr(value, a) for a in ("packed_bytes", "in_features", "out_features")):
                numel, size = int(value.in_features) * int(value.out_features), int(value.packed_bytes)  # PackedLinear
            else:
                continue
            (vocab if name in VOCAB_TABLES else weights).append((numel, size))
    if vocab:
        weights.append(min(vocab, key=lambda w: w[1]))
    return sum(n for n, _ in weights), sum(size for _, size in weights)


def runner_step_cost(runner: Any) -> StepCost:
    """The modelled (a, b) of a ModelRunner's decode steps: its model's weights on its device."""
    num_params, weight_bytes = weight_footprint(runner.model)
    return modelled_step_cost(num_params, weight_bytes, runner.device, runner.dtype)


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
    wipes the row's evidence from that position on (its acceptance has changed). A probe the
    proposer cannot fill costs nothing and is repeated next step.

    Rows that cannot finish last get no drafts: with no request waiting for admission the batch
    only shrinks, so a token that a row commits early does not shorten the run unless that row is
    the last to finish; it only spares that row's own verify token b later, which the draft cost
    already, so a draft there pays only if it is always accepted. The engine knows which rows can
    still be last (a row's most remaining tokens >= another's fewest, see LLMEngine); where it
    cannot tell (a request may stop at EOS or a stop string any time) every row can.
    """

    WARMUP_STEPS = 4  # first steps: probes on a few rows only (the batch's estimate starts optimistic)

    def __init__(self, k: int, probe_every: int = 48, decay: float = 0.95, margin: float = 0.05,
                 prior_weight: float = 1.0, *, step_cost: StepCost | None = None) -> None:
        # margin: speculate only for an expected gain above it; the model omits the proposal and
        # verification overheads, so near break-even plain decoding is the safer choice
        self.k, self.probe_every, self.decay, self.margin = k, probe_every, decay, margin
        self.prior_weight = prior_weight
        # (a, b): T(n) = a + b n; None: DEFAULT_STEP_COST (for_runner gives the modelled one)
        self.step_cost = DEFAULT_STEP_COST if step_cost is None else check_step_cost(step_cost)
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

    @classmethod
    def for_runner(cls, k: int, runner: Any, step_cost: StepCost | None = None, **kw: Any) -> "DraftLengthPolicy":
        """The policy for a ModelRunner's steps: step_cost if given (SpeculativeConfig.step_cost),
        else the cost model's for its model and device (runner_step_cost); nothing is timed."""
        return cls(k, step_cost=step_cost if step_cost is not None else runner_step_cost(runner), **kw)

    # ---- the plan ------------------------------------------------------------------------------
    def draft_lengths(self, slots: np.ndarray, seq_ids: np.ndarray,
                      can_finish_last: np.ndarray | None = None) -> np.ndarray:
        """Drafts to propose for each running decode request (0..k, one per row of the scheduler's
        decode view: request slots and seq ids). can_finish_last: one bool per request (None: all
        True); a False row gets none (see the class docstring)."""
        rows = np.asarray(slots, dtype=np.int64)
        self._claim(rows, np.asarray(seq_ids, dtype=np.int64))
        self.planned[:] = 0
        self.probes[:] = -1
        num_rows = len(rows)
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
            lengths = self._best_lengths(rows, eligible, *self.cost_line())
            # The next position of a row left unverified for long enough: probe it (and beyond).
            interval = self.probe_every * max(1.0, num_rows / self.k)
            can_grow = np.nonzero(eligible & (lengths < self.k))[0]
            stale = can_grow[self.idle[rows[can_grow], lengths[can_grow]] >= interval]
            self.probes[rows[stale]] = lengths[stale]
            lengths[stale] = np.minimum(lengths[stale] + probe, self.k)
        self.planned[rows] = lengths
        return lengths.astype(np.int32)

    def _best_lengths(self, rows: np.ndarray, eligible: np.ndarray, a: float, b: float) -> np.ndarray:
        """Greedy marginal allocation of drafts over the eligible rows (see the class docstring).
        Only b / a matters: scaling both scales `seconds` and `b` alike in the test below."""
        num_rows, k = len(rows), self.k
        p = self.acceptance(rows) * eligible[:, None]  # [R, k], non-increasing along k
        h = self.found[rows] / self.asked[rows]
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

    def observe_rows(self, slots: np.ndarray, num_drafts: np.ndarray, num_committed: np.ndarray) -> None:
        """The decode rows of a step (request slots): drafts verified and tokens committed per row
        (rows this step's plan asked nothing of are ignored)."""
        slots = np.asarray(slots, dtype=np.int64)
        asked = np.nonzero(self.planned[slots] > 0)[0]
        if not len(asked):
            return
        rows = slots[asked]
        drafts = np.asarray(num_drafts)[asked]
        accepted = np.asarray(num_committed)[asked] - 1
        self.asked[rows] = self.decay * self.asked[rows] + 1.0
        self.found[rows] = self.decay * self.found[rows] + (drafts > 0)
        cols = np.arange(self.k)
        verified = cols[None, :] < drafts[:, None]  # [rows, k]: position j verified
        tried = verified & (cols[None, :] <= accepted[:, None])  # ... after all earlier ones were accepted
        passed = cols[None, :] < accepted[:, None]
        # An accepted probe: the row's acceptance has changed, forget its evidence from there on.
        start = self.probes[rows]
        forget = (start >= 0) & (accepted > start)
        if forget.any():
            wipe = forget[:, None] & (cols[None, :] >= start[:, None])
            self.trials[rows] = np.where(wipe, 0.0, self.trials[rows])
            self.accepts[rows] = np.where(wipe, 0.0, self.accepts[rows])
        has = drafts > 0  # rows with evidence this step: their counts decay, at every position
        if has.any():
            seen = rows[has]
            self.trials[seen] = self.decay * self.trials[seen] + tried[has]
            self.accepts[seen] = self.decay * self.accepts[seen] + passed[has]
            self.pool_trials = self.decay * self.pool_trials + tried.sum(axis=0)
            self.pool_accepts = self.decay * self.pool_accepts + passed.sum(axis=0)
            self.idle[seen] = np.where(verified[has], 0, self.idle[seen])

    # ---- internals -------------------------------------------------------------------------------
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
