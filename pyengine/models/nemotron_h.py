"""NemotronH (NemotronHForCausalLM) layer pattern: one mixer per block, h += mixer(norm(h)), with
blocks "M" Mamba2 (the shared Mamba2Mixer), "*" attention (GQA, no RoPE, no MLP) and "-" MLP
(up -> relu^2 -> down). MoE blocks ("E") are not supported.

An attention block is the attention half of pyengine/models/layers.py's LlamaDecoderLayer (built
without an MLP) with no rotation. Mamba2 dt is clamped below at time_step_min, as HF does. The trunk
(embedding, state, KV caches, final norm, lm_head) is pyengine/models/hybrid.py's.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pyengine.config import hf_common_fields
from pyengine.engine.attention_metadata import AttentionMetadata
from pyengine.engine.state_cache import StateMetadata
from pyengine.models.bamba import BambaModelConfig
from pyengine.models.hybrid import HybridForCausalLM
from pyengine.models.layers import (LlamaDecoderLayer, Mamba2Block, WeightTargets, linear, pack_weights, param,
                                    rms_norm_rows)
from pyengine.models.weight_utils import load_named_weights

_PATTERN = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}


@dataclass
class NemotronHModelConfig(BambaModelConfig):
    layer_types: tuple[str, ...] = ()


def nemotron_h_model_config(cfg: dict[str, Any]) -> NemotronHModelConfig:
    types = cfg.get("layers_block_type") or [_PATTERN[c] for c in cfg["hybrid_override_pattern"]]
    if any(t not in ("linear_attention", "full_attention", "mlp") for t in types):
        raise ValueError(f"NemotronH: unsupported block types {sorted(set(types))} (MoE blocks are not supported)")
    if cfg.get("mlp_hidden_act", "relu2") != "relu2" or cfg.get("mamba_hidden_act", "silu") != "silu":
        raise ValueError("NemotronH: only mlp_hidden_act = relu2 and mamba_hidden_act = silu are supported")
    if cfg.get("mlp_bias") or cfg.get("attention_bias") or cfg.get("residual_in_fp32"):
        raise ValueError("NemotronH: mlp_bias, attention_bias and residual_in_fp32 are not supported")
    hidden, num_heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    return NemotronHModelConfig(
        **hf_common_fields(cfg, max_position_embeddings=4096),
        intermediate_size=int(cfg["intermediate_size"]), num_hidden_layers=len(types),
        num_attention_heads=num_heads, num_key_value_heads=int(cfg.get("num_key_value_heads") or num_heads),
        head_dim=int(cfg.get("head_dim") or hidden // num_heads), rms_norm_eps=float(cfg.get("layer_norm_epsilon", 1e-5)),
        num_ssm_heads=int(cfg["mamba_num_heads"]), ssm_head_dim=int(cfg["mamba_head_dim"]),
        state_size=int(cfg["ssm_state_size"]), n_groups=int(cfg.get("n_groups", 1)),
        conv_kernel=int(cfg.get("conv_kernel", 4)), expand=int(cfg.get("expand", 2)),
        chunk_size=int(cfg.get("chunk_size", 128)), use_bias=bool(cfg.get("use_bias", False)),
        use_conv_bias=bool(cfg.get("use_conv_bias", True)),
        time_step_limit=(float(cfg.get("time_step_min", 0.001)), float("inf")),  # HF's mixer hardcodes this
        attn_layer_indices=tuple(i for i, t in enumerate(types) if t == "full_attention"), rotary_dim=0,
        layer_types=tuple(types),
    )


class NemotronHMLPBlock(nn.Module):
    """h + down(relu(up(RMSNorm(h)))^2)."""

    def __init__(self, config: NemotronHModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = config.rms_norm_eps
        self.norm = param(config.hidden_size, dtype=dtype)
        self.up_proj: Any = param(config.hidden_size, config.intermediate_size, dtype=dtype)  # [in, out]
        self.down_proj: Any = param(config.intermediate_size, config.hidden_size, dtype=dtype)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = rms_norm_rows(h, self.norm, self.eps)
        return h + linear(torch.relu(linear(x, self.up_proj)).square(), self.down_proj)

    def pack(self, pack: Callable[[torch.Tensor], Any]) -> None:
        pack_weights(self, ("up_proj", "down_proj"), pack)


class NemotronHForCausalLM(HybridForCausalLM):
    hf_embed_name = "model.embeddings.weight"
    hf_norm_name = "model.norm_f.weight"

    def __init__(self, config: NemotronHModelConfig, dtype: torch.dtype = torch.float32) -> None:
        blocks = {"linear_attention": lambda: Mamba2Block(config, dtype),
                  "full_attention": lambda: LlamaDecoderLayer(config, dtype, mlp=False),
                  "mlp": lambda: NemotronHMLPBlock(config, dtype)}
        super().__init__(config, dtype, (blocks[t]() for t in config.layer_types))

    def run_layers(self, h: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, kv_caches: list,
                   state: StateMetadata) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            if isinstance(layer, Mamba2Block):
                h = layer(h, state, state.conv[i], state.ssm[i])
            elif isinstance(layer, LlamaDecoderLayer):
                h = layer.attention(h, None, None, meta, kv_caches[i])  # no RoPE
            else:
                h = layer(h)
        return h

    def weight_targets(self) -> WeightTargets:
        t = super().weight_targets()
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            if isinstance(layer, LlamaDecoderLayer):
                t[p + "norm.weight"] = (layer.input_layernorm, layer.input_layernorm)
                t.update(layer.attention_weight_targets(p + "mixer."))
            elif isinstance(layer, NemotronHMLPBlock):
                t[p + "norm.weight"] = (layer.norm, layer.norm)
                t[p + "mixer.up_proj.weight"] = (layer.up_proj, layer.up_proj.t())
                t[p + "mixer.down_proj.weight"] = (layer.down_proj, layer.down_proj.t())
            else:
                t.update(layer.weight_targets(p))
        return t

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        # Checkpoints name the trunk backbone.* (NVIDIA's files, and transformers' save_pretrained) or model.*
        renamed = (("model." + n[len("backbone."):] if n.startswith("backbone.") else n, w) for n, w in weights)
        load_named_weights(self, self.weight_targets(), renamed, self.lm_head is None)
