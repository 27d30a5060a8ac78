"""C++ owns request state: a speculative decode step calls into the scheduler a fixed number of
times, whatever the number of rows (the decode view, the proposal calls, schedule, update, the finished
outputs), for the
ngram proposer and for a draft model."""
from __future__ import annotations

from typing import Any

import pytest

from pyengine import LLM, SamplingParams
from tests.test_spec_decode import make_prompts
from tests.tiny_models import make_checkpoint


class CountingScheduler:
    """Wraps the C++ scheduler and counts every attribute read: each is one call into C++."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls = 0

    def __getattr__(self, name: str) -> Any:
        self.calls += 1
        return getattr(self.inner, name)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[str, str]:
    target, draft = str(tmp_path_factory.mktemp("target")), str(tmp_path_factory.mktemp("draft"))
    make_checkpoint("llama_gqa_untied", target)
    make_checkpoint("qwen3_qk_norm", draft, seed=1)
    return target, draft


def calls_per_decode_step(llm: LLM, num_rows: int, steps: int = 6) -> set[int]:
    """Calls into the scheduler in each of `steps` steps whose rows all decode."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for prompt in make_prompts(num_rows):
        engine.add_request([3, 4] + prompt, params)
    counter = CountingScheduler(engine.scheduler)
    engine.scheduler = counter
    while counter.inner.num_waiting or any(counter.inner.num_computed(s) < len(counter.inner.token_ids(s)) - 1
                                           for s in counter.inner.running_ids()):
        engine.step()  # prefills
    seen = set()
    for _ in range(steps):
        counter.calls = 0
        engine.step()
        seen.add(counter.calls)
    assert counter.inner.num_running == num_rows, "a request finished during the measured steps"
    return seen


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
@pytest.mark.parametrize("adaptive", [True, False])
def test_calls_per_step_do_not_grow_with_rows(checkpoints: tuple[str, str], method: str, adaptive: bool) -> None:
    target, draft = checkpoints
    spec = {"method": method, "num_speculative_tokens": 3, "adaptive_draft_length": adaptive}
    if method == "ngram":
        spec.update(prompt_lookup_min=1, prompt_lookup_max=3)
    else:
        spec["model"] = draft
    counts = {}
    for rows in (1, 32):
        llm = LLM(model=target, device="cpu", speculative_config=spec, block_size=4, max_model_len=128)
        counts[rows] = calls_per_decode_step(llm, rows)
    if not adaptive:  # every row drafts every step: the same calls at both sizes
        assert counts[1] == counts[32], counts
    # adaptive: the cost model may give a large batch's rows no drafts in some steps, which skips
    # the proposal calls (fewer crossings, never more)
    assert max(counts[1]) <= 7 and max(counts[32]) <= 7, counts  # draft model: view, tails, tables, drafts, schedule, update, finished
