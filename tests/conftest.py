"""Shared fixtures: the repo root on sys.path, the embedded SmolLM2 GGUF loaded once, and the CPU
pool put back after tests that change it."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    from pyengine.loader import default_model_path

    try:
        return default_model_path()
    except ValueError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def smollm2_fp32(smollm2_path: str):
    """(model, config, tokenizer) of the default GGUF in float32, loaded once per session."""
    import torch

    from pyengine.loader import load_model

    return load_model(smollm2_path, "cpu", torch.float32)


@pytest.fixture
def restore_pool():
    """Tests that change the C++ CPU pool (its threads, its stall policy) or torch's thread count
    put them back to the defaults afterwards."""
    import torch

    from pyengine.ops import cpu as cpu_ops

    threads = torch.get_num_threads()
    yield
    cpu_ops.kernels.set_pool_adaptive(True)
    cpu_ops.kernels.set_pool_absent_fraction(0.5)
    torch.set_num_threads(threads)
    cpu_ops.kernels.set_num_threads(threads)
