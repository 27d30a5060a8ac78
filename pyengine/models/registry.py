"""Model registry: HF `architectures` name -> the model class and the builder of its config.

A new architecture is a model file plus one line here.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn

from pyengine.config import ModelConfig, architecture_of
from pyengine.models.bamba import BambaForCausalLM, bamba_model_config
from pyengine.models.deepseek_v3 import DeepseekV3ForCausalLM, deepseek_v3_model_config
from pyengine.models.llama import LlamaForCausalLM, llama_model_config
from pyengine.models.mamba2 import Mamba2ForCausalLM, mamba2_model_config
from pyengine.models.qwen3_next import Qwen3NextForCausalLM, qwen3_5_model_config, qwen3_next_model_config
from pyengine.models.nemotron_h import NemotronHForCausalLM, nemotron_h_model_config


class ModelEntry(NamedTuple):
    model_class: Callable[[Any, torch.dtype], nn.Module]
    config_from_hf: Callable[[dict[str, Any]], ModelConfig]


_MODELS: dict[str, ModelEntry] = {
    "LlamaForCausalLM": ModelEntry(LlamaForCausalLM, llama_model_config),
    "Qwen2ForCausalLM": ModelEntry(LlamaForCausalLM, llama_model_config),  # qkv bias: config.attention_bias
    "Qwen3ForCausalLM": ModelEntry(LlamaForCausalLM, llama_model_config),  # per-head q/k RMSNorm: config.qk_norm
    "Mamba2ForCausalLM": ModelEntry(Mamba2ForCausalLM, mamba2_model_config),  # recurrent state: StateCache
    "BambaForCausalLM": ModelEntry(BambaForCausalLM, bamba_model_config),  # Mamba2 + attention hybrid
    "NemotronHForCausalLM": ModelEntry(NemotronHForCausalLM, nemotron_h_model_config),  # M / * / - blocks, no MoE
    "DeepseekV3ForCausalLM": ModelEntry(DeepseekV3ForCausalLM, deepseek_v3_model_config),  # MLA + MoE (+ MTP); Kimi-K2
    "Qwen3NextForCausalLM": ModelEntry(Qwen3NextForCausalLM, qwen3_next_model_config),  # Gated DeltaNet hybrid (+ MTP)
    # Qwen3.5: the same layers, projections stored apart; the multimodal ones load their text part
    "Qwen3_5ForCausalLM": ModelEntry(Qwen3NextForCausalLM, qwen3_5_model_config),
    "Qwen3_5MoeForCausalLM": ModelEntry(Qwen3NextForCausalLM, qwen3_5_model_config),
    "Qwen3_5ForConditionalGeneration": ModelEntry(Qwen3NextForCausalLM, qwen3_5_model_config),
    "Qwen3_5MoeForConditionalGeneration": ModelEntry(Qwen3NextForCausalLM, qwen3_5_model_config),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def _entry(architecture: str) -> ModelEntry:
    entry = _MODELS.get(architecture)
    if entry is None:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: {', '.join(supported_architectures())}")
    return entry


def get_model_class(architecture: str) -> Callable[[Any, torch.dtype], nn.Module]:
    return _entry(architecture).model_class


def model_config_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    """A HF config.json dict (the GGUF loader builds the same) -> its architecture's ModelConfig."""
    return _entry(architecture_of(cfg)).config_from_hf(cfg)


def build_model(config: ModelConfig, dtype: torch.dtype) -> nn.Module:
    return get_model_class(config.architecture)(config, dtype)
