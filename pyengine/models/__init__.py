"""Model registry: HF architecture name -> model class."""
from __future__ import annotations

import torch
from torch import nn

from pyengine.config import ModelConfig
from pyengine.models.bamba import BambaForCausalLM
from pyengine.models.llama import LlamaForCausalLM
from pyengine.models.mamba2 import Mamba2ForCausalLM
from pyengine.models.nemotron_h import NemotronHForCausalLM

_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,  # qkv bias, flagged by config.attention_bias
    "Qwen3ForCausalLM": LlamaForCausalLM,  # per-head q/k RMSNorm, flagged by config.qk_norm
    "Mamba2ForCausalLM": Mamba2ForCausalLM,  # recurrent state: runner-owned StateCache
    "BambaForCausalLM": BambaForCausalLM,  # Mamba2 + attention hybrid (pyengine/models/bamba.py)
    "NemotronHForCausalLM": NemotronHForCausalLM,  # M / * / - block pattern, no MoE (nemotron_h.py)
}


def supported_architectures() -> list[str]:
    return sorted(_REGISTRY)


def get_model_class(architecture: str) -> type[nn.Module]:
    cls = _REGISTRY.get(architecture)
    if cls is None:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: {', '.join(supported_architectures())}")
    return cls


def build_model(config: ModelConfig, dtype: torch.dtype) -> nn.Module:
    return get_model_class(config.architecture)(config, dtype)
