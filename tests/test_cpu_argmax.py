"""pyengine.ops.cpu.sampling.argmax_finite (csrc/cpu/cpu_argmax.cpp), the greedy sampler's CPU
reductions, against what it replaces: NumPy's argmax (the first maximum, the first NaN where a row
has one) and sampler.finite_rows (no NaN or +-inf), on rows with ties, signed zeros, NaN and inf."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pyengine.engine.greedy_sampler import GreedySampler
from pyengine.engine.sampler import finite_rows

sampling = pytest.importorskip("pyengine.ops.cpu.sampling")


@pytest.mark.parametrize("width", [1, 3, 7, 8, 9, 17, 100, 49152])
def test_argmax_finite_equals_numpy(width: int) -> None:
    rng = np.random.default_rng(width)
    for trial in range(200):
        x = rng.standard_normal((int(rng.integers(1, 5)), width)).astype(np.float32)
        if trial % 3 == 0:
            x = np.round(x)  # ties: the first maximum wins
        for row in x:
            for _ in range(int(rng.integers(0, 6))):
                row[rng.integers(0, width)] = rng.choice([np.nan, np.inf, -np.inf, 0.0, -0.0, 5.0])
        logits = torch.from_numpy(x)
        tok, finite = sampling.argmax_finite(logits)
        want = x.argmax(axis=-1)
        assert tok.tolist() == want.tolist()
        assert finite.tolist() == finite_rows(logits, torch.from_numpy(want)).tolist()


def test_strided_rows_and_other_inputs() -> None:
    x = torch.randn(4, 100)[:, :64]  # rows 100 apart
    tok, finite = sampling.argmax_finite(x)
    assert tok.tolist() == x.numpy().argmax(-1).tolist() and finite.all()
    assert sampling.argmax_finite(x.double()) is None and sampling.argmax_finite(x.t()) is None


def test_the_greedy_sampler_takes_it_on_cpu() -> None:
    x = torch.randn(3, 1000)
    x[1, 7] = float("nan")
    tok, host, finite, ready = GreedySampler(1).start(x)
    assert ready is None and tok.tolist() == x.numpy().argmax(-1).tolist() and finite.tolist() == [True, False, True]
