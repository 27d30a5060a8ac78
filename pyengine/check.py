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

Every output token's logits are recorded (EngineConfig.record_logits); each row of a comparison gets
one status, "identical", "logits_differ", "tie", "diverged" or "error" (pyengine/check_rows.py:
what they mean and the tie bound).

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
import gc
import time
from typing import Any, Callable, Iterator, Sequence

import torch

from pyengine.check_rows import Report, RowResult, RowRun, compare_rows, logit_bits, significant_bits

DEFAULT_SPEC = {"method": "ngram", "num_speculative_tokens": 4}


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
        if torch.equal(logit_bits(y), logit_bits(x)):
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

