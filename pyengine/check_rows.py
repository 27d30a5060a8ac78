"""Two greedy runs of the same prompts compared row by row, for the losslessness checker
(pyengine/check.py): the statuses, the tie bound and the report.

Every output token's logits are recorded (EngineConfig.record_logits: the fp32 copy of the logits
that produced it). A row of a comparison gets one status:

- "identical":     the same token ids and bit-identical logits at every position;
- "logits_differ": the same token ids, but some logits differ in their bits;
- "tie":           the token ids diverge at a position where the two tokens were tied to within
                   the final rounding of the logits (the bound below);
- "diverged":      the token ids diverge by more than that, or one run stopped early;
- "error":         a request of either run ended with an error.

For a row that is not identical the report gives the first position whose logits differ, the
first position whose tokens differ, the largest |logit difference| over the positions whose
context is still shared (up to and including the first token divergence: after it the two runs
continue different texts), and at the token divergence the reference's top-2 gap.

The tie bound. The model computes its logits in its dtype: the final projection's sum (fp32
accumulators) is rounded to the model's dtype, which keeps p significant bits (bf16: 8, fp16: 11,
fp32: 24), and the engine records that rounded value. The unit in the last place at a magnitude x
is ulp(x) = 2**(floor(log2|x|) - (p - 1)); rounding to nearest moves a value by at most ulp/2.
Two runs that compute the same real value in different summation orders (another batch shape,
another kernel) get accumulators that differ by a tiny d, and after rounding two results that are
either equal or adjacent: each logit may differ between the runs by one ulp. Call a and b the
reference's token and the other run's token at the first divergence; the reference has
l_a >= l_b, the other run l'_b >= l'_a. Their swing,

    swing = (l_a - l_b) - (l'_a - l'_b)  >= 0,

is at most ulp(a) + ulp(b) when only the final rounding differs (each of the two logits moved by
at most one ulp; both can move, in opposite directions, when both lay next to a rounding
boundary). So a divergence with swing <= ulp(a) + ulp(b) (each ulp at the larger magnitude of
that token's logit in the two runs) is a "tie": the reference's top-2 gap was itself at most two
ulps, and either summation order may break it either way. Anything larger is "diverged". Note the
bound is two ulps of the swing, not one ulp of the reference's gap: a gap of two ulps can close to
an exact tie (both logits straddling a boundary), which argmax then breaks by token id.

What this does not prove: the classification accounts only for the final rounding. Different
summation orders earlier in the network (every GEMM, the attention, the norms; in bf16 also the
rounding of every activation) change the unrounded logits by more than a tiny d, and those
differences can grow through the layers, so a genuine order-only difference can exceed the bound
and is then reported as "diverged". A "tie" means the two runs agree to within what the last
rounding alone allows, no more; a batch-invariant engine (KernelConfig.batch_invariant: asked for,
or picked by the engine for the model, pyengine/engine/invariance.py) computes the same bits
whatever the batch and speculation, so strict mode (default on when the engine runs invariant)
fails on any bit difference at all.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import torch

STATUSES = ("identical", "logits_differ", "tie", "diverged", "error")
PASSING = {False: ("identical", "logits_differ", "tie"), True: ("identical",)}  # strict -> passing statuses
COMPARISONS = {"spec": "speculative vs plain, batched", "alone": "plain alone vs plain batched"}


# ---- the bound ------------------------------------------------------------------------------------


def significant_bits(dtype: torch.dtype) -> int:
    """p: the significand's bits including the implicit one (fp32 24, bf16 8, fp16 11)."""
    return 1 - int(math.log2(torch.finfo(dtype).eps))


def ulp(x: float, dtype: torch.dtype) -> float:
    """The unit in the last place of `dtype` at |x|: 2**(floor(log2|x|) - (p - 1)); at 0 (and for
    subnormals) the spacing of the smallest normal binade."""
    fi = torch.finfo(dtype)
    x = max(abs(float(x)), fi.tiny)
    _, e = math.frexp(x)  # x = m * 2**e, m in [0.5, 1): floor(log2 x) = e - 1
    return math.ldexp(1.0, e - 1 - (significant_bits(dtype) - 1))


# ---- one row compared ----------------------------------------------------------------------------


@dataclass
class RowRun:
    """One request's outcome: output token ids, logits [n, vocab] (the logits of each output
    token), finish reason, error."""
    token_ids: list[int]
    logits: torch.Tensor | None
    finish_reason: str | None = None
    error: str | None = None


@dataclass
class Comparison:
    status: str
    ref_tokens: int  # output tokens of the reference
    other_tokens: int
    first_logit_diff: int | None = None  # first output position whose logits differ in any bit
    first_token_diff: int | None = None  # first output position whose token differs (or where one run stopped)
    max_abs_logit_diff: float = 0.0  # over the positions of shared context: 0 .. first_token_diff
    ref_token: int | None = None  # at first_token_diff
    other_token: int | None = None
    top2_gap: float | None = None  # the reference's top-1 minus top-2 logit at first_token_diff
    swing: float | None = None  # (l_a - l_b) - (l'_a - l'_b) at first_token_diff, a/b the two runs' tokens
    tie_bound: float | None = None  # ulp(a) + ulp(b)
    ulp: float | None = None  # ulp at the reference's top-1 logit
    note: str = ""


def logit_bits(x: torch.Tensor) -> torch.Tensor:
    return x.float().contiguous().view(torch.int32)


def compare_rows(ref: RowRun, other: RowRun, dtype: torch.dtype) -> Comparison:
    """Compare one row of two greedy runs of the same prompt (see the module docstring)."""
    n_ref, n_other = len(ref.token_ids), len(other.token_ids)
    if ref.error or other.error:
        which = "reference" if ref.error else "other run"
        return Comparison("error", n_ref, n_other, note=f"{which}: {ref.error or other.error}")
    for run in (ref, other):
        n = 0 if run.logits is None else run.logits.shape[0]
        if n != len(run.token_ids):
            return Comparison("error", n_ref, n_other,
                              note=f"{len(run.token_ids)} tokens but {n} recorded logits (was record_logits set?)")
    common = min(n_ref, n_other)
    first_token = next((i for i in range(common) if ref.token_ids[i] != other.token_ids[i]),
                       common if n_ref != n_other else None)
    # positions whose context both runs share: up to and including the first token divergence
    shared = common if first_token is None else min(first_token + 1, common)
    a, b = ref.logits[:shared].float(), other.logits[:shared].float()
    differs = (logit_bits(a) != logit_bits(b)).any(dim=1).nonzero()
    first_logit = int(differs[0]) if differs.numel() else None
    max_diff = float((a - b).abs().max()) if shared and first_logit is not None else 0.0
    c = Comparison("identical", n_ref, n_other, first_logit_diff=first_logit, first_token_diff=first_token,
                   max_abs_logit_diff=max_diff)
    if first_token is None:
        c.status = "identical" if first_logit is None else "logits_differ"
        return c
    if first_token >= common:  # one run is a prefix of the other
        c.status = "diverged"
        shorter = "the other run" if n_other < n_ref else "the reference"
        c.note = f"{shorter} stopped at {common} tokens ({other.finish_reason} vs reference {ref.finish_reason})"
        return c
    ta, tb = ref.token_ids[first_token], other.token_ids[first_token]
    la, lb = ref.logits[first_token].double(), other.logits[first_token].double()  # exact differences
    top2 = torch.topk(la, 2).values
    c.ref_token, c.other_token = ta, tb
    c.top2_gap = float(top2[0] - top2[1])
    c.ulp = ulp(float(top2[0]), dtype)
    c.swing = float((la[ta] - la[tb]) - (lb[ta] - lb[tb]))
    c.tie_bound = (ulp(max(abs(float(la[ta])), abs(float(lb[ta]))), dtype)
                   + ulp(max(abs(float(la[tb])), abs(float(lb[tb]))), dtype))
    finite = bool(torch.isfinite(la[[ta, tb]]).all() and torch.isfinite(lb[[ta, tb]]).all())
    c.status = "tie" if finite and c.swing <= c.tie_bound else "diverged"
    if first_logit is None:
        c.note = "bit-identical logits: the two runs broke an exact tie of the argmax differently"
    return c


# ---- the report ------------------------------------------------------------------------------------


def _dash(v: int | None) -> str:
    return "-" if v is None else str(v)


@dataclass
class RowResult:
    index: int
    prompt: str | None
    num_prompt_tokens: int
    num_output_tokens: int  # the reference's
    finish_reason: str | None  # the reference's
    comparisons: dict[str, Comparison] = field(default_factory=dict)


@dataclass
class Report:
    model: str
    device: str
    dtype: str
    speculative_config: dict[str, Any]
    max_tokens: int
    batch_invariant: bool  # what the engine ran
    strict: bool
    significant_bits: int
    rows: list[RowResult] = field(default_factory=list)
    runs: dict[str, dict[str, Any]] = field(default_factory=dict)  # run name -> seconds, engine stats

    @property
    def comparison_names(self) -> list[str]:
        return [name for name in COMPARISONS if any(name in r.comparisons for r in self.rows)]

    def counts(self, name: str) -> dict[str, int]:
        out = dict.fromkeys(STATUSES, 0)
        for r in self.rows:
            if name in r.comparisons:
                out[r.comparisons[name].status] += 1
        return out

    def failures(self) -> list[tuple[int, str, Comparison]]:
        ok = PASSING[self.strict]
        return [(r.index, name, c) for r in self.rows for name, c in r.comparisons.items() if c.status not in ok]

    @property
    def passed(self) -> bool:
        return not self.failures()

    @property
    def exit_code(self) -> int:
        return 0 if self.passed else 1

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model, "device": self.device, "dtype": self.dtype,
            "speculative_config": self.speculative_config, "max_tokens": self.max_tokens,
            "batch_invariant": self.batch_invariant, "strict": self.strict, "significant_bits": self.significant_bits,
            "passed": self.passed,
            "summary": {name: self.counts(name) for name in self.comparison_names},
            "runs": self.runs,
            "rows": [{**{k: v for k, v in dataclasses.asdict(r).items() if k != "comparisons"},
                      "comparisons": {n: dataclasses.asdict(c) for n, c in r.comparisons.items()}} for r in self.rows],
        }

    def format_table(self, prompt_width: int = 40) -> str:
        spec = self.speculative_config
        spec_text = spec.get("method", "draft_model" if spec.get("model") else "?")
        spec_text += f" k={spec.get('num_speculative_tokens')}"
        spec_text += f" draft={spec['model']}" if spec.get("model") else ""
        lines = [f"losslessness check: {self.model} on {self.device}, {self.dtype} "
                 f"({self.significant_bits} significant bits); spec {spec_text}; max_tokens {self.max_tokens}; "
                 f"batch_invariant {self.batch_invariant}; strict {'on' if self.strict else 'off'}"]
        names = self.comparison_names
        header = f"{'row':>4}  {'tokens':>6}  {'run':<6} {'status':<13} {'1st logit d':>11} {'1st token d':>11} " \
                 f"{'max|d logit|':>12} {'top-2 gap':>10} {'swing/bound':>19}  prompt"
        lines += [header, "-" * len(header)]
        for r in self.rows:
            prompt = (r.prompt or "").replace("\n", " ")
            prompt = prompt if len(prompt) <= prompt_width else prompt[:prompt_width - 3] + "..."
            for j, name in enumerate(names):
                c = r.comparisons.get(name)
                if c is None:
                    continue
                gap = "-" if c.top2_gap is None else f"{c.top2_gap:.3g}"
                swing = "-" if c.swing is None else f"{c.swing:.3g}/{c.tie_bound:.3g}"
                row_text = f"{r.index:>4}  {r.num_output_tokens:>6}" if j == 0 else " " * 12
                lines.append(f"{row_text}  {name:<6} {c.status:<13} {_dash(c.first_logit_diff):>11} "
                             f"{_dash(c.first_token_diff):>11} {c.max_abs_logit_diff:>12.3g} {gap:>10} {swing:>19}  "
                             f"{prompt if j == 0 else ''}".rstrip())
                if c.note:
                    lines.append(" " * 20 + c.note)
        lines.append("")
        for name in names:
            counts = self.counts(name)
            found = ", ".join(f"{counts[s]} {s}" for s in STATUSES if counts[s])
            lines.append(f"{name} ({COMPARISONS[name]}): {found}")
        stats = self.runs.get("spec", {}).get("stats", {})
        if "acceptance_rate" in stats:
            lines.append(f"spec: {stats['num_draft_tokens']} drafted, {stats['num_accepted_tokens']} accepted "
                         f"(rate {stats['acceptance_rate']:.2f}, "
                         f"mean acceptance length {stats['mean_acceptance_length']:.2f})")
        failures = self.failures()
        if failures:
            allowed = "identical" if self.strict else "identical, logits_differ or tie"
            lines.append(f"FAIL: {len(failures)} row(s) not {allowed}")
        else:
            lines.append("PASS" + (" (strict: every row bit-identical)" if self.strict else ""))
        return "\n".join(lines)
