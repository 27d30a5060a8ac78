"""NemotronH (NemotronHForCausalLM) layer pattern: one mixer per block, h += mixer(norm(h)), with
blocks "M" Mamba2 (the shared Mamba2Mixer), "*" attention (GQA, no RoPE, no MLP) and "-" MLP
(up -> relu^2 -> down). MoE blocks ("E") are not supported.

An attention block is the attention half of pyengine/models/llama.py's LlamaDecoderLayer (built
without an MLP) with cos = 1, sin = 0 (no rotation). Mamba2 dt is clamped below at time_step_min, as HF does. KV cache: as in bamba.py, the
runner allocates a pair per layer and only attention layers use theirs (waste on M and - blocks).
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pyengine.engine.attention_metadata import AttentionMetadata
from pyengine.models.bamba import BambaModelConfig, load_hf_weights
from pyengine.models.llama import LlamaDecoderLayer, linear
from pyengine.models.mamba2 import Mamba2Mixer
from pyengine.engine.state_cache import StateCache, StateMetadata

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
    eos = cfg.get("eos_token_id")
    hidden, num_heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    return NemotronHModelConfig(
        architecture=str(cfg["architectures"][0]), vocab_size=int(cfg["vocab_size"]), hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]), num_hidden_layers=len(types),
        num_attention_heads=num_heads, num_key_value_heads=int(cfg.get("num_key_value_heads") or num_heads),
        head_dim=int(cfg.get("head_dim") or hidden // num_heads), rms_norm_eps=float(cfg.get("layer_norm_epsilon", 1e-5)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        bos_token_id=None if cfg.get("bos_token_id") is None else int(cfg["bos_token_id"]),
        eos_token_ids=[] if eos is None else [int(e) for e in (eos if isinstance(eos, list) else [eos])],
        num_ssm_heads=int(cfg["mamba_num_heads"]), ssm_head_dim=int(cfg["mamba_head_dim"]),
        state_size=int(cfg["ssm_state_size"]), n_groups=int(cfg.get("n_groups", 1)),
        conv_kernel=int(cfg.get("conv_kernel", 4)), expand=int(cfg.get("expand", 2)),
        chunk_size=int(cfg.get("chunk_size", 128)), use_bias=bool(cfg.get("use_bias", False)),
        use_conv_bias=bool(cfg.get("use_conv_bias", True)),
        time_step_limit=(float(cfg.get("time_step_min", 0.001)), float("inf")),  # HF's mixer hardcodes this
        attn_layer_indices=tuple(i for i, t in enumerate(types) if t == "full_attention"), rotary_dim=0,
        layer_types=tuple(types),
    )


class _Norm(nn.Module):
    def __init__(self, config: NemotronHModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = config.rms_norm_eps
        self.norm = nn.Parameter(torch.empty(config.hidden_size, dtype=dtype), requires_grad=False)

    def normed(self, h: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(h, (h.shape[-1],), self.norm, self.eps)


class NemotronHMambaBlock(_Norm):
    def __init__(self, config: NemotronHModelConfig, dtype: torch.dtype) -> None:
        super().__init__(config, dtype)
        self.mixer = Mamba2Mixer(config, dtype)

    def forward(self, h: torch.Tensor, state: StateMetadata, conv: torch.Tensor, ssm: torch.Tensor) -> torch.Tensor:
        return h + self.mixer(self.normed(h), state, conv, ssm)


class NemotronHMLPBlock(_Norm):
    def __init__(self, config: NemotronHModelConfig, dtype: torch.dtype) -> None:
        super().__init__(config, dtype)
        self.up_proj = nn.Parameter(torch.empty(config.hidden_size, config.intermediate_size, dtype=dtype),
                                    requires_grad=False)  # [in, out]
        self.down_proj = nn.Parameter(torch.empty(config.intermediate_size, config.hidden_size, dtype=dtype),
                                      requires_grad=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + linear(torch.relu(linear(self.normed(h), self.up_proj)).square(), self.down_proj)


class NemotronHForCausalLM(nn.Module):
    def __init__(self, config: NemotronHModelConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config, self.dtype = config, dtype
        blocks = {"linear_attention": lambda: NemotronHMambaBlock(config, dtype),
                  "full_attention": lambda: LlamaDecoderLayer(config, dtype, mlp=False),
                  "mlp": lambda: NemotronHMLPBlock(config, dtype)}
        self.layers = nn.ModuleList(blocks[t]() for t in config.layer_types)
        self.embeddings = nn.Parameter(torch.empty(config.vocab_size, config.hidden_size, dtype=dtype), requires_grad=False)
        self.norm_f = nn.Parameter(torch.empty(config.hidden_size, dtype=dtype), requires_grad=False)
        self.lm_head = None if config.tie_word_embeddings else nn.Parameter(
            torch.empty(config.vocab_size, config.hidden_size, dtype=dtype), requires_grad=False)

    def state_shapes(self, num_spec_tokens: int) -> list:
        return [layer.mixer.state_shape(num_spec_tokens) if isinstance(layer, NemotronHMambaBlock) else None
                for layer in self.layers]

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list, state: StateMetadata | None = None) -> torch.Tensor:
        if state is None:
            state = StateCache.scratch(self, meta.query_start_loc, self.dtype, input_ids.device)
        h = F.embedding(input_ids, self.embeddings)
        for i, layer in enumerate(self.layers):
            if isinstance(layer, NemotronHMambaBlock):
                h = layer(h, state, state.conv[i], state.ssm[i])
            elif isinstance(layer, LlamaDecoderLayer):
                h = layer.attention(h, None, None, meta, kv_caches[i])  # no RoPE
            else:
                h = layer(h)
        return F.rms_norm(h, (h.shape[-1],), self.norm_f, self.config.rms_norm_eps)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.embeddings if self.lm_head is None else self.lm_head).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        cfg = self.config
        hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        t: dict[str, tuple[torch.Tensor, torch.Tensor]] = {
            "model.embeddings.weight": (self.embeddings, self.embeddings), "model.norm_f.weight": (self.norm_f, self.norm_f)}
        if self.lm_head is not None:
            t["lm_head.weight"] = (self.lm_head, self.lm_head)
        mixer_names = {"in_proj.weight": "in_proj", "in_proj.bias": "in_proj_bias", "conv1d.weight": "conv_weight",
                       "conv1d.bias": "conv_bias", "dt_bias": "dt_bias", "A_log": "A_log", "D": "D",
                       "norm.weight": "norm", "out_proj.weight": "out_proj", "out_proj.bias": "out_proj_bias"}
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            if isinstance(layer, LlamaDecoderLayer):
                t[p + "norm.weight"] = (layer.input_layernorm, layer.input_layernorm)
                qkv = layer.qkv_proj.t()
                t[p + "mixer.q_proj.weight"] = (layer.qkv_proj, qkv.narrow(0, 0, hq * d))
                t[p + "mixer.k_proj.weight"] = (layer.qkv_proj, qkv.narrow(0, hq * d, hkv * d))
                t[p + "mixer.v_proj.weight"] = (layer.qkv_proj, qkv.narrow(0, (hq + hkv) * d, hkv * d))
                t[p + "mixer.o_proj.weight"] = (layer.o_proj, layer.o_proj.t())
                continue
            t[p + "norm.weight"] = (layer.norm, layer.norm)
            if isinstance(layer, NemotronHMLPBlock):
                t[p + "mixer.up_proj.weight"] = (layer.up_proj, layer.up_proj.t())
                t[p + "mixer.down_proj.weight"] = (layer.down_proj, layer.down_proj.t())
            else:
                for hf, ours in mixer_names.items():
                    param = getattr(layer.mixer, ours)
                    if param is not None:
                        t[p + "mixer." + hf] = (param, param)
        # Checkpoints name the trunk backbone.* (NVIDIA's files, and transformers' save_pretrained) or model.*
        renamed = (("model." + n[len("backbone."):] if n.startswith("backbone.") else n, w) for n, w in weights)
        load_hf_weights(self, t, renamed, self.lm_head is None, torch.arange(d), d)
