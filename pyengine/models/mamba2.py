"""Mamba2 (Mamba2ForCausalLM): a stack of Mamba2 blocks (pyengine.models.layers.Mamba2Block)."""
from __future__ import annotations

from typing import Any

import torch

from pyengine.config import Mamba2ModelConfig, hf_common_fields, json_float
from pyengine.engine.attention_metadata import AttentionMetadata
from pyengine.engine.state_cache import StateMetadata
from pyengine.models.hybrid import HybridForCausalLM
from pyengine.models.layers import Mamba2Block, WeightTargets


def mamba2_model_config(cfg: dict[str, Any]) -> Mamba2ModelConfig:
    """The attention fields describe a 1x1 KV cache: the scheduler still pages positions in blocks,
    a pure Mamba2 model never reads them."""
    hidden = int(cfg["hidden_size"])
    limit = cfg.get("time_step_limit") or (0.0, float("inf"))
    return Mamba2ModelConfig(
        **hf_common_fields(cfg, max_position_embeddings=8192),
        intermediate_size=int(cfg.get("expand", 2) * hidden), num_hidden_layers=int(cfg["num_hidden_layers"]),
        num_attention_heads=1, num_key_value_heads=1, head_dim=1,
        rms_norm_eps=float(cfg.get("layer_norm_epsilon", 1e-5)),
        num_ssm_heads=int(cfg["num_heads"]), ssm_head_dim=int(cfg["head_dim"]), state_size=int(cfg["state_size"]),
        n_groups=int(cfg.get("n_groups", 1)), conv_kernel=int(cfg.get("conv_kernel", 4)),
        expand=int(cfg.get("expand", 2)), chunk_size=int(cfg.get("chunk_size", 256)),
        use_bias=bool(cfg.get("use_bias", False)), use_conv_bias=bool(cfg.get("use_conv_bias", True)),
        time_step_limit=(json_float(limit[0]), json_float(limit[1])),
    )


class Mamba2ForCausalLM(HybridForCausalLM):
    uses_kv_cache = False  # no attention layers: the runner's KV pool is a placeholder
    hf_embed_name = "backbone.embeddings.weight"
    hf_norm_name = "backbone.norm_f.weight"

    def __init__(self, config: Mamba2ModelConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__(config, dtype, (Mamba2Block(config, dtype) for _ in range(config.num_hidden_layers)))

    def run_layers(self, h: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, kv_caches: list,
                   state: StateMetadata) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            h = layer(h, state, state.conv[i], state.ssm[i])
        return h

    def weight_targets(self) -> WeightTargets:
        t = super().weight_targets()
        for i, layer in enumerate(self.layers):
            t.update(layer.weight_targets(f"backbone.layers.{i}."))
        return t
