"""Shared fixtures: the repo root on sys.path, and the embedded SmolLM2 GGUF loaded once."""
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
