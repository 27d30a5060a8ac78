"""The losslessness checker: does speculative decoding (and batching) change anything the model says?

    python -m pyengine.check --spec ngram --num-spec-tokens 4 --prompts-file F [--json] [--strict]

    from pyengine.check import check_losslessness
    report = check_losslessness(["What is 2+2?", ...], speculative_config={"method": "ngram",
                                "num_speculative_tokens": 4}, max_tokens=64)
    report.passed, report.rows[i].comparisons["spec"].status, print(report.format_table())

Greedy decoding (temperature 0) of the same prompts, runs compared row by row against the
reference run (1), plain decoding with all the prompts batched:

- "spec": (2) speculative decoding, all the prompts batched (a second LLM with the same weights;
  the loaded model is shared, see share_loaded_models);
- "alone": (3) plain decoding with each prompt alone, a batch of one (optional: alone=False).

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

Pass / exit code: without strict, the check passes (exit 0) when every row of every comparison is
"identical", "logits_differ" (the outputs are the same) or "tie"; strict passes only when every
row is "identical". Otherwise exit 1; bad input exits 2 with one error line (the CLI).

Memory: the reference keeps prompts x max_tokens x vocab logits (4 bytes each; 2 when the model
dtype is 16-bit, where the values are exact in it), and the run being compared as much again.
"""
from __future__ import annotations

if __name__ == "__main__":  # the CLI first: its bad-input errors come before torch is imported
    from pyengine.entrypoints.check import main

    raise SystemExit(main())

import contextlib
import dataclasses
import gc
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch

STATUSES = ("identical", "logits_differ", "tie", "diverged", "error")
PASSING = {False: ("identical", "logits_differ", "tie"), True: ("identical",)}  # strict -> passing statuses
COMPARISONS = {"spec": "speculative vs plain, batched", "alone": "plain alone vs plain batched"}
DEFAULT_SPEC = {"method": "ngram", "num_speculative_tokens": 4}


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


def _bits(x: torch.Tensor) -> torch.Tensor:
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
    differs = (_bits(a) != _bits(b)).any(dim=1).nonzero()
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


# ---- running ---------------------------------------------------------------------------------------

_shared_cache: dict | None = None


@contextlib.contextmanager
def share_loaded_models() -> Iterator[None]:
    """Within the block, every LLM built with the same (model path, device, dtype, kernel config)
    gets one loaded model object (pyengine.engine.llm.load_model memoised): the plain and the
    speculative engines of a check then run the very same weights, and the model is loaded once.
    The engines share nothing else (each has its KV cache, scheduler and runner; the model's
    forward keeps no state between calls). Nested blocks share the outermost block's cache."""
    global _shared_cache
    if _shared_cache is not None:
        yield
        return
    import pyengine.engine.llm as llm_module
    from pyengine.ops.kernel_config import get_kernel_config

    original = llm_module.load_model
    cache: dict = {}

    def load_shared(path: str | None, device: str = "cpu", dtype: torch.dtype = torch.float32, load_mtp: bool = False):
        key = (path, str(device), dtype, get_kernel_config(), load_mtp)
        if key not in cache:
            cache[key] = original(path, device, dtype, load_mtp=load_mtp)
        return cache[key]

    _shared_cache = cache
    llm_module.load_model = load_shared
    try:
        yield
    finally:
        llm_module.load_model = original
        _shared_cache = None


def _build_llm(**kwargs: Any) -> Any:
    """One engine of the check (a seam: tests wrap it to perturb a run)."""
    from pyengine import LLM

    return LLM(**kwargs)


def _free(device: torch.device) -> None:
    """After the last reference to an LLM is dropped: its KV cache back before the next one's."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _store(logits: list, dtype: torch.dtype) -> torch.Tensor | None:
    """A request's logits as one [n, vocab] tensor: in the model's 16-bit dtype when every value is
    exact in it (what the model computed), else fp32."""
    if not logits:
        return None
    x = torch.stack(logits)
    if dtype in (torch.float16, torch.bfloat16):
        y = x.to(dtype)
        if torch.equal(_bits(y), _bits(x)):
            return y
    return x


def _run(llm: Any, encoded: list[tuple[str | None, list[int]]], max_tokens: int,
         dtype: torch.dtype) -> list[RowRun]:
    """Greedy run of these prompts as one batch; each request's logits recorded and stored compactly
    (the engine's per-step logits are copied out as they come, so a step's whole logits tensor is
    not kept alive by the rows of it that were committed)."""
    from pyengine import SamplingParams

    engine = llm.engine
    engine.cfg.record_logits = True
    copied: dict[int, int] = {}

    def compact(touched: list) -> None:
        for req in list(engine.requests.values()) + list(touched):
            done = copied.get(req.request_id, 0)
            for i in range(done, len(req.logits)):
                req.logits[i] = req.logits[i].clone()
            copied[req.request_id] = len(req.logits)

    params = [SamplingParams(max_tokens=max_tokens, temperature=0.0)] * len(encoded)
    reqs = llm.run_requests(encoded, params, compact)
    out = []
    for r in reqs:
        out.append(RowRun(list(r.output_token_ids), _store(r.logits, dtype), r.finish_reason, r.error))
        r.logits = []
    return out


def _encode(llm: Any, prompts: Sequence[str | list[int]], chat: bool, max_tokens: int
            ) -> list[tuple[str | None, list[int]]]:
    from pyengine.entrypoints.generate import encode_prompts

    encoded: list[tuple[str | None, list[int]]] = []
    for p in prompts:
        encoded += encode_prompts(llm.tokenizer, [p], chat) if isinstance(p, str) else [(None, list(p))]
    limit = llm.engine.cfg.max_model_len
    for i, (_, ids) in enumerate(encoded):
        if len(ids) + max_tokens > limit:
            raise ValueError(f"prompt {i} is too long: {len(ids)} tokens + max_tokens {max_tokens} exceeds "
                             f"max_model_len {limit}")
    return encoded


def _validate(prompts: Any, max_tokens: Any, speculative_config: Any) -> list[str | list[int]]:
    from pyengine.spec_decode.config import SpeculativeConfig

    if isinstance(prompts, str) or not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts must be a non-empty list of prompts (strings or token-id lists)")
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            if not p.strip():
                raise ValueError(f"prompt {i} is empty")
        elif not (isinstance(p, (list, tuple)) and p
                  and all(isinstance(t, int) and not isinstance(t, bool) for t in p)):
            raise ValueError(f"prompt {i} must be a non-empty str or a non-empty list of int token ids")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise ValueError(f"max_tokens must be a positive int, got {max_tokens!r}")
    SpeculativeConfig.from_dict(speculative_config)  # raises ValueError on a bad config
    return list(prompts)


def check_losslessness(prompts: Sequence[str | list[int]], *, model: str | None = None, device: str = "auto",
                       dtype: str | torch.dtype = "auto", speculative_config: dict[str, Any] | None = None,
                       max_tokens: int = 64, alone: bool = True, chat: bool = True,
                       batch_invariant: bool | None = None, strict: bool | None = None,
                       log: Callable[[str], None] | None = None, **llm_kwargs: Any) -> Report:
    """Run `prompts` greedily (1) plain, batched, (2) with speculative_config (default ngram, k=4),
    batched, (3) with alone=True, plain with each prompt alone, and compare (2) and (3) with (1) row
    by row (the module docstring says how). prompts: strings (rendered with the chat template when
    chat and the model has one) or token-id lists. strict: pass only on bit-identical rows
    (default: whether the engine runs batch-invariant, as asked or as it picks for the model).
    llm_kwargs go to both LLMs (max_num_seqs, block_size, enable_prefix_caching, kernel_config, ...). log: called with a line per finished run.
    Raises ValueError on bad input."""
    spec = dict(DEFAULT_SPEC if speculative_config is None else speculative_config)
    prompt_list = _validate(prompts, max_tokens, spec)
    say = log or (lambda line: None)
    kwargs = dict(model=model, device=device, dtype=dtype, batch_invariant=batch_invariant, **llm_kwargs)
    with share_loaded_models():
        t0 = time.perf_counter()
        llm = _build_llm(**kwargs)
        model_dtype = llm.dtype
        invariant = bool(llm.kernel_config.batch_invariant)  # None above: the engine's choice for the model
        report = Report(model=model or "default (SmolLM2-135M-Instruct GGUF)", device=str(llm.device),
                        dtype=str(model_dtype).replace("torch.", ""), speculative_config=spec,
                        max_tokens=max_tokens, batch_invariant=invariant, strict=invariant if strict is None else strict,
                        significant_bits=significant_bits(model_dtype))
        say(f"loaded {report.model} on {report.device} in {report.dtype} ({time.perf_counter() - t0:.1f} s)")
        encoded = _encode(llm, prompt_list, chat, max_tokens)

        t0 = time.perf_counter()
        ref = _run(llm, encoded, max_tokens, model_dtype)
        report.runs["plain"] = {"seconds": time.perf_counter() - t0, "stats": llm.stats()}
        say(f"plain, batched: {len(encoded)} prompts, {sum(len(r.token_ids) for r in ref)} tokens "
            f"({report.runs['plain']['seconds']:.1f} s)")
        for i, ((text, ids), r) in enumerate(zip(encoded, ref)):
            report.rows.append(RowResult(i, prompt_list[i] if isinstance(prompt_list[i], str) else text, len(ids),
                                         len(r.token_ids), r.finish_reason))
        if alone:
            t0 = time.perf_counter()
            for i, e in enumerate(encoded):
                (one,) = _run(llm, [e], max_tokens, model_dtype)
                report.rows[i].comparisons["alone"] = compare_rows(ref[i], one, model_dtype)
            report.runs["alone"] = {"seconds": time.perf_counter() - t0}
            say(f"plain, alone: {report.counts('alone')['identical']}/{len(encoded)} identical "
                f"({report.runs['alone']['seconds']:.1f} s)")
        llm = None  # one engine at a time: on a GPU each takes most of the free memory for its KV cache
        _free(torch.device(report.device))

        llm = _build_llm(speculative_config=spec, **kwargs)
        t0 = time.perf_counter()
        runs = _run(llm, encoded, max_tokens, model_dtype)
        report.runs["spec"] = {"seconds": time.perf_counter() - t0, "stats": llm.stats()}
        for i, r in enumerate(runs):
            report.rows[i].comparisons["spec"] = compare_rows(ref[i], r, model_dtype)
        say(f"speculative, batched: {report.counts('spec')['identical']}/{len(encoded)} identical "
            f"({report.runs['spec']['seconds']:.1f} s)")
        llm = None
        _free(torch.device(report.device))
    return report

