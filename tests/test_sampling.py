"""SamplingParams validation, logits processing (hand-checked), and seeded sampling."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats

from pyengine.engine.sampler import (
    RequestGenerators,
    SamplingTensors,
    compute_probs,
    derive_seed,
    probs_from_params,
    sample_from_probs,
)
from pyengine.sampling_params import SamplingParams
from pyengine.spec_decode.rejection_sampler import RejectionSampler


def sample(logits: torch.Tensor, params: list[SamplingParams], gens: list) -> torch.Tensor:
    """One token per row, the way the engine samples rows without drafts (the rejection
    sampler's d = 0 rows)."""
    none = torch.zeros(len(params), dtype=torch.long)
    return RejectionSampler()(logits, torch.zeros(0, dtype=torch.long), none, None, params, gens).flat_tokens

# A hand-checkable distribution: sorted, distinct, no ties.
BASE = torch.tensor([0.5, 0.3, 0.15, 0.05])
BASE_LOGITS = BASE.log().unsqueeze(0)


def processed(**kw) -> torch.Tensor:
    return probs_from_params(BASE_LOGITS, [SamplingParams(**kw)])[0]


# ---------------------------------------------------------------- SamplingParams validation

INVALID = [
    ("temperature", {"temperature": -0.1}),
    ("temperature", {"temperature": float("inf")}),
    ("temperature", {"temperature": float("nan")}),
    ("temperature", {"temperature": "hot"}),
    ("top_p", {"top_p": 0.0}),
    ("top_p", {"top_p": 1.01}),
    ("top_p", {"top_p": float("nan")}),
    ("top_k", {"top_k": 0}),
    ("top_k", {"top_k": -2}),
    ("top_k", {"top_k": 2.5}),
    ("min_p", {"min_p": -0.01}),
    ("min_p", {"min_p": 1.5}),
    ("max_tokens", {"max_tokens": 0}),
    ("max_tokens", {"max_tokens": -3}),
    ("stop", {"stop": 5}),
    ("stop", {"stop": ["ok", 3]}),
    ("stop", {"stop": [""]}),
    ("stop_token_ids", {"stop_token_ids": [1, -1]}),
    ("stop_token_ids", {"stop_token_ids": [1.0]}),
    ("stop_token_ids", {"stop_token_ids": 7}),
    ("seed", {"seed": 1.5}),
    ("seed", {"seed": "42"}),
    ("ignore_eos", {"ignore_eos": "yes"}),
]


@pytest.mark.parametrize("field,kwargs", INVALID)
def test_invalid_params_name_the_field(field: str, kwargs: dict) -> None:
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    message = str(info.value)
    assert message.startswith(field + " ") and "\n" not in message


def test_valid_params_and_normalisation() -> None:
    p = SamplingParams()
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens) == (1.0, 1.0, -1, 0.0, 16)
    assert p.stop == [] and p.stop_token_ids == [] and p.seed is None and not p.is_greedy
    q = SamplingParams(temperature=0, top_k=1, top_p=1, min_p=1, stop="END", stop_token_ids=(2, 0), seed=-5)
    assert q.is_greedy and q.stop == ["END"] and q.stop_token_ids == [2, 0]
    assert SamplingParams(stop=["a", "b"]).stop == ["a", "b"]
    assert not SamplingParams(temperature=1e-3).is_greedy


# ---------------------------------------------------------------- filters, hand-checked


def test_no_filter_is_softmax() -> None:
    torch.testing.assert_close(processed(), BASE)


def test_temperature() -> None:
    expected = BASE.double() ** 2 / (BASE.double() ** 2).sum()  # T = 0.5 squares the probs
    torch.testing.assert_close(processed(temperature=0.5).double(), expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    "top_k,expected",
    [(1, [1, 0, 0, 0]), (2, [0.625, 0.375, 0, 0]), (3, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0]),
     (4, [0.5, 0.3, 0.15, 0.05]), (100, [0.5, 0.3, 0.15, 0.05])],
)
def test_top_k(top_k: int, expected: list[float]) -> None:
    torch.testing.assert_close(processed(top_k=top_k), torch.tensor(expected, dtype=torch.float32), atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    "top_p,expected",
    [(0.4, [1, 0, 0, 0]), (0.75, [0.625, 0.375, 0, 0]), (0.85, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0]),
     (0.99, [0.5, 0.3, 0.15, 0.05]), (1e-9, [1, 0, 0, 0])],
)
def test_top_p(top_p: float, expected: list[float]) -> None:
    torch.testing.assert_close(processed(top_p=top_p), torch.tensor(expected, dtype=torch.float32), atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    "min_p,expected",
    [(0.32, [0.625, 0.375, 0, 0]), (0.2, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0]),
     (1.0, [1, 0, 0, 0]), (0.05, [0.5, 0.3, 0.15, 0.05])],
)
def test_min_p(min_p: float, expected: list[float]) -> None:
    torch.testing.assert_close(processed(min_p=min_p), torch.tensor(expected, dtype=torch.float32), atol=1e-6, rtol=0)


def test_filters_compose_in_order() -> None:
    # top_k=3 -> [.5,.3,.15]/.95; top_p=0.8 keeps {.5,.3} (mass before 0.15 is .842 >= .8);
    # min_p=0.7 then drops 0.375 < 0.7 * 0.625.
    torch.testing.assert_close(processed(top_k=3, top_p=0.8), torch.tensor([0.625, 0.375, 0, 0]))
    torch.testing.assert_close(processed(top_k=3, top_p=0.8, min_p=0.7), torch.tensor([1.0, 0, 0, 0]))


def test_top_k_keeps_ties() -> None:
    probs = probs_from_params(torch.tensor([[1.0, 2.0, 2.0, 2.0, 0.0]]), [SamplingParams(top_k=2)])[0]
    assert torch.equal(probs > 0, torch.tensor([False, True, True, True, False]))


def test_mixed_batch_equals_rows_alone() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 50, generator=gen) * 3
    params = [SamplingParams(), SamplingParams(top_k=7, temperature=0.6), SamplingParams(top_p=0.5),
              SamplingParams(min_p=0.2, temperature=1.3), SamplingParams(temperature=0)]
    batch = probs_from_params(logits, params)
    for i, p in enumerate(params):
        torch.testing.assert_close(batch[i], probs_from_params(logits[i:i + 1], [p])[0])
    assert SamplingTensors.from_params(params[:1], 50).top_k is None  # fast path when unused


# ---------------------------------------------------------------- sampling


def test_greedy_argmax_lowest_index_on_ties() -> None:
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0], [5.0, 5.0, 5.0, 5.0], [-1.0, -2.0, -0.5, -0.5]])
    tokens = sample(logits, [SamplingParams(temperature=0)] * 3, [None] * 3)
    assert tokens.tolist() == [1, 0, 2]


def test_sample_from_probs_matches_distribution_and_skips_zero_mass() -> None:
    probs = torch.tensor([0.0, 0.2, 0.0, 0.5, 0.3, 0.0]).repeat(20000, 1)
    u = torch.rand(20000, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    tokens = sample_from_probs(probs, u)
    counts = np.bincount(tokens.numpy(), minlength=6)
    assert counts[[0, 2, 5]].sum() == 0
    assert stats.chisquare(counts[[1, 3, 4]], 20000 * np.array([0.2, 0.5, 0.3])).pvalue > 1e-3
    edge = sample_from_probs(torch.tensor([[0.3, 0.7, 0.0], [0.0, 0.0, 1.0]]), torch.tensor([1 - 1e-17, 0.0]))
    assert edge.tolist() == [1, 2]


def test_sampler_frequencies_follow_processed_probs() -> None:
    n = 20000
    logits = BASE_LOGITS.repeat(n, 1)
    params = [SamplingParams(temperature=0.8, top_k=3)] * n
    gens = RequestGenerators(engine_seed=3)
    tokens = sample(logits, params, [gens.get(i) for i in range(n)])
    counts = np.bincount(tokens.numpy(), minlength=4)
    expected = processed(temperature=0.8, top_k=3).double().numpy()
    assert counts[3] == 0
    assert stats.chisquare(counts[:3], n * expected[:3] / expected[:3].sum()).pvalue > 1e-3


def _run_steps(logits: torch.Tensor, params: list[SamplingParams], gens: list, steps: int) -> list[list[int]]:
    return [sample(logits, params, gens).tolist() for _ in range(steps)]


def test_seeded_reproducibility() -> None:
    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(5))
    params = [SamplingParams(seed=11), SamplingParams(seed=12, top_p=0.9), SamplingParams(seed=13)]

    def run() -> list[list[int]]:
        pool = RequestGenerators(engine_seed=0)
        return _run_steps(logits, params, [pool.get(f"r{i}", p.seed) for i, p in enumerate(params)], 20)

    first, second = run(), run()
    assert first == second
    assert len({tuple(step) for step in first}) > 1  # it really samples


def test_row_independent_of_batch() -> None:
    logits = torch.randn(6, 64, generator=torch.Generator().manual_seed(2)) * 2
    target = SamplingParams(seed=99, temperature=0.9, top_k=20)
    alone = _run_steps(logits[2:3], [target], [RequestGenerators().get("x", 99)], 30)
    others = [SamplingParams(seed=i, top_p=0.7) for i in range(4)]
    params = others[:2] + [target] + others[2:] + [SamplingParams(temperature=0)]
    pool = RequestGenerators()
    gens = [pool.get(i, p.seed) for i, p in enumerate(params)]
    batched = _run_steps(logits, params, gens, 30)
    assert [step[2] for step in batched] == [step[0] for step in alone]


def test_request_generators_derive_stable_distinct_seeds() -> None:
    assert derive_seed(7, "req-1") == derive_seed(7, "req-1")
    assert derive_seed(7, "req-1") != derive_seed(7, "req-2") != derive_seed(8, "req-2")
    a, b = RequestGenerators(engine_seed=7), RequestGenerators(engine_seed=7)
    draws_a = torch.rand(4, generator=a.get("req-1"))
    assert torch.equal(draws_a, torch.rand(4, generator=b.get("req-1")))
    assert not torch.equal(torch.rand(4, generator=a.get("req-2")), torch.rand(4, generator=b.get("req-1")))
    explicit = torch.rand(4, generator=RequestGenerators(engine_seed=1).get("z", seed=5))
    assert torch.equal(explicit, torch.rand(4, generator=RequestGenerators(engine_seed=2).get("y", seed=5)))
    assert "req-1" in a and len(a) == 2
    a.release("req-1")
    assert "req-1" not in a and len(a) == 1


def test_non_greedy_row_without_generator_is_an_error() -> None:
    with pytest.raises(ValueError):
        sample(BASE_LOGITS, [SamplingParams()], [None])


def test_probs_are_normalised_under_filters() -> None:
    logits = torch.randn(8, 1000, generator=torch.Generator().manual_seed(3)) * 4
    params = [SamplingParams(top_k=k, top_p=tp, min_p=mp, temperature=t)
              for k, tp, mp, t in [(-1, 1, 0, 1), (5, 1, 0, 1), (-1, 0.3, 0, 2), (50, 0.9, 0.1, 0.5)] * 2]
    probs = compute_probs(logits, SamplingTensors.from_params(params, 1000))
    assert torch.all(probs >= 0) and torch.allclose(probs.sum(-1), torch.ones(8), atol=1e-5)
    assert math.isclose(float((probs[1] > 0).sum()), 5)


def test_top_p_window_and_full_sort_paths_agree_with_reference() -> None:
    # V > the top-p window: a flat row's nucleus overflows it (full-sort fallback), a peaked
    # row's fits (window path); both must equal a plain sort-based reference.
    gen = torch.Generator().manual_seed(9)
    logits = torch.cat([torch.randn(1, 3000, generator=gen) * 0.1, torch.randn(1, 3000, generator=gen) * 6])
    params = [SamplingParams(top_p=0.9), SamplingParams(top_p=0.9, top_k=2000)]
    probs = probs_from_params(logits, params)
    for row in range(2):
        p = torch.softmax(logits[row].double(), -1)
        sorted_p, order = torch.sort(p, descending=True)
        if params[row].top_k > 0:
            sorted_p[params[row].top_k:] = 0
            sorted_p /= sorted_p.sum()
        keep = order[(torch.cumsum(sorted_p, 0) - sorted_p) < 0.9]
        expected = torch.zeros_like(p)
        expected[keep] = p[keep] / p[keep].sum()
        assert 1 < keep.numel() < 3000
        torch.testing.assert_close(probs[row].double(), expected, atol=1e-6, rtol=1e-4)
