"""Harness for losslessness tests: run plain and speculative greedy decoding, record every step's
batch shape, and accept a divergence only at a proven numerical near-tie."""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from scipy import stats
import torch

from pyengine import LLM, SamplingParams
from tests.scripted_proposer import make_llm
from tests.tiny_models import make_prompts
from tests.utils_paged import make_meta

NEAR_TIE = 1e-4


@dataclass
class StepRecord:
    num_computed: np.ndarray
    num_scheduled: np.ndarray
    num_drafts: np.ndarray
    num_decode_rows: int
    committed: np.ndarray | None = None  # tokens the verifier kept per row


@dataclass
class RecordingScheduler:
    """Wraps the C++ scheduler: records what each step scheduled and what was committed."""
    inner: Any
    steps: list[StepRecord] = field(default_factory=list)

    def schedule(self):
        b = self.inner.schedule()
        qsl = b.query_start_loc
        self.steps.append(StepRecord(b.num_computed.copy(), np.diff(qsl), b.num_draft_tokens.copy(), b.num_decode_rows))
        return b

    def update(self, tokens, counts):
        self.steps[-1].committed = np.asarray(counts).copy()
        return self.inner.update(tokens, counts)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    # -- what the steps covered ------------------------------------------------------------------
    def verify_rows(self) -> list[tuple[int, int, int, int]]:
        """(num_computed, num_scheduled, drafts, committed) of every decode row that carried drafts."""
        rows = []
        for s in self.steps:
            for r in range(s.num_decode_rows):
                if s.num_drafts[r] > 0:
                    rows.append((int(s.num_computed[r]), int(s.num_scheduled[r]), int(s.num_drafts[r]), int(s.committed[r])))
        return rows

    def had_ragged_step(self) -> bool:
        """A step whose decode rows include both rows with drafts and rows with none."""
        return any((s.num_drafts[:s.num_decode_rows] > 0).any() and (s.num_drafts[:s.num_decode_rows] == 0).any()
                   for s in self.steps)

    def had_mixed_step(self) -> bool:
        """A step with verify rows (drafts) and prefill rows together."""
        return any((s.num_drafts[:s.num_decode_rows] > 0).any() and len(s.num_drafts) > s.num_decode_rows
                   for s in self.steps)


def run(model: str, prompts: list[list[int]], max_tokens: int = 24, spec: dict | None = None,
        params: SamplingParams | None = None, **llm_kw: Any) -> tuple[list[list[int]], dict, RecordingScheduler, LLM]:
    llm = make_llm(model, spec, device="cpu", **llm_kw)
    rec = RecordingScheduler(llm.engine.scheduler)
    llm.engine.scheduler = rec
    params = params or SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert all(o.error is None for o in outs), [o.error for o in outs]
    return [o.outputs[0].token_ids for o in outs], llm.stats(), rec, llm


@functools.lru_cache(maxsize=None)
def plain_greedy(path: str, n: int, max_tokens: int) -> tuple[tuple[tuple[int, ...], ...], tuple[torch.Tensor, ...]]:
    """Plain greedy outputs of make_prompts(n) and every committed token's logits (cached)."""
    llm = LLM(path, device="cpu")
    llm.engine.cfg.record_logits = True
    reqs = llm.run_requests([(None, p) for p in make_prompts(n)],
                            [SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)] * n)
    return tuple(tuple(r.output_token_ids) for r in reqs), tuple(torch.stack(r.logits) for r in reqs)


def spec_equals_plain(path: str, spec: dict, batch: int, max_tokens: int, **llm_kw: Any) -> tuple[dict, RecordingScheduler]:
    """Greedy decoding of make_prompts(batch) with speculation equals plain_greedy bit for bit:
    tokens and every committed token's logits. Returns the run's stats and its recorded steps."""
    llm = LLM(path, device="cpu", speculative_config=spec, **llm_kw)
    llm.engine.cfg.record_logits = True
    rec = RecordingScheduler(llm.engine.scheduler)
    llm.engine.scheduler = rec
    reqs = llm.run_requests([(None, p) for p in make_prompts(batch)],
                            [SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)] * batch)
    tokens, logits = plain_greedy(path, batch, max_tokens)
    assert [tuple(r.output_token_ids) for r in reqs] == list(tokens)
    for r, ref in zip(reqs, logits):
        assert torch.equal(torch.stack(r.logits), ref), f"request {r.request_id}: logits differ from plain decoding"
    return llm.stats(), rec


@torch.inference_mode()
def top2_gap(llm: LLM, tokens: list[int]) -> float:
    """Target logit gap between the best two tokens after `tokens` (a fresh contiguous forward)."""
    from tests.utils_paged import PagedCache

    cfg = llm.model_config
    cache = PagedCache(cfg, len(tokens) // 16 + 2, 16, llm.dtype)
    table: list[int] = []
    cache.grow(table, len(tokens))
    meta, pos = make_meta([(table, 0, len(tokens))], 16)
    hidden = llm.model(torch.tensor(tokens), pos, meta, cache.kv_caches)
    top = llm.model.compute_logits(hidden[-1:])[0].topk(2).values
    return float(top[0] - top[1])


def assert_lossless(llm: LLM, prompts: list[list[int]], plain: list[list[int]], spec: list[list[int]]) -> None:
    """spec == plain token for token; a divergence passes only at a proven near-tie of the target."""
    for prompt, a, b in zip(prompts, plain, spec):
        if a == b:
            continue
        i = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        gap = top2_gap(llm, prompt + a[:i])
        assert gap < NEAR_TIE, f"spec diverged from plain at output {i} with top-2 gap {gap:.3g}: {a} vs {b}"


def assert_follows(samples: np.ndarray, probs: torch.Tensor, what: str) -> None:
    """Chi-square goodness of fit; bins with expected count < 5 are merged."""
    n = len(samples)
    expected = probs.double().numpy() * n
    observed = np.bincount(samples, minlength=len(expected)).astype(np.float64)
    assert observed[expected == 0].sum() == 0, f"{what}: a zero-probability token was emitted"
    big = expected >= 5
    obs = np.append(observed[big], observed[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] < 5:
        obs, exp = obs[:-1], exp[:-1]
    exp *= obs.sum() / exp.sum()
    p_value = stats.chisquare(obs, exp).pvalue
    assert p_value > 1e-4, f"{what}: chi-square p = {p_value:.2e}"


def check_second_token_follows_target(path: str, spec: dict, prompt: list[int], n: int = 1500) -> dict:
    """n identical temperature-1 requests with speculation: the second output token comes out of
    the first verify step (an accepted draft or the rejection sampler's resample). Among requests
    whose first token is the most frequent, it must follow the target's p(. | prompt, t1). Returns
    the speculative run's stats."""
    llm = LLM(path, device="cpu", max_num_seqs=n, max_num_batched_tokens=n * len(prompt), speculative_config=spec)
    outs = llm.generate([prompt] * n, [SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, seed=i)
                                       for i in range(n)], use_tqdm=False)
    st = llm.stats()
    assert st["num_accepted_tokens"] > 0, st
    pairs = np.array([o.outputs[0].token_ids[:2] for o in outs])
    t1 = int(np.bincount(pairs[:, 0]).argmax())
    second = pairs[pairs[:, 0] == t1, 1]
    plain = LLM(path, device="cpu")
    plain.engine.cfg.record_logits = True
    req = plain.run_requests([(None, prompt + [t1])], [SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)])[0]
    assert len(second) > 100, f"only {len(second)} requests share the first token"
    assert_follows(second, torch.softmax(req.logits[0], dim=-1), "second token ~ p")
    return st
