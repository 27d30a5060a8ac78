"""Bamba (BambaForCausalLM): Mamba2 mixers and attention layers interleaved (HF attn_layer_indices).

Every layer is pre-norm: h += mixer(input_layernorm(h)); h += MLP(pre_ff_layernorm(h)), where the
mixer is a Mamba2 mixer (pyengine/models/layers.py, state in the runner's StateCache) or GQA
attention over the paged KV cache. An attention layer is exactly a LlamaDecoderLayer
(pyengine/models/layers.py: pre_ff_layernorm is its post_attention_layernorm; gate|up -> silu -> down),
so it is reused as is; a Mamba layer pairs the shared Mamba2Mixer with the same MLP.

Partial RoPE (Bamba: partial_rotary_factor 0.5): HF rotates the first r of the d head dims as
rotate_half pairs (j, j + r/2). The Llama layer rotates pairs (j, j + d/2) over the whole head, so the
q and k rows of every head are permuted at load time to put HF's pair (j, j + r/2) at (j, j + d/2)
and the pass-through dims elsewhere; their cos is 1 and sin 0. q.k is invariant under one
permutation applied to both, and v / o_proj are untouched, so the output equals HF's.

The trunk (embedding, state, KV caches, final norm, lm_head) is pyengine/models/hybrid.py's.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pyengine.config import Mamba2ModelConfig, hf_common_fields, json_float, rope_scaling_from_hf, rope_theta_from_hf
from pyengine.engine.attention_metadata import AttentionMetadata
from pyengine.engine.state_cache import StateMetadata
from pyengine.models.hybrid import HybridForCausalLM
from pyengine.models.layers import (LlamaDecoderLayer, Mamba2Mixer, RotaryEmbedding, WeightTargets, linear,
                                    pack_weights, param, rms_norm_rows, rowwise)
from pyengine.models.weight_utils import load_named_weights


@dataclass
class BambaModelConfig(Mamba2ModelConfig):
    """Mamba2ModelConfig (SSM fields) whose attention fields are real, plus the layer pattern."""
    attn_layer_indices: tuple[int, ...] = ()
    rotary_dim: int = 0  # leading head dims rotated by RoPE (head_dim * partial_rotary_factor)


def bamba_model_config(cfg: dict[str, Any]) -> BambaModelConfig:
    hidden = int(cfg["hidden_size"])
    num_heads = int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or hidden // num_heads)
    expand = int(cfg.get("mamba_expand", 2))
    ssm_heads = int(cfg["mamba_n_heads"])
    d_head = cfg.get("mamba_d_head", "auto")
    ssm_head_dim = expand * hidden // ssm_heads if d_head in (None, "auto") else int(d_head)
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    partial = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.5)))  # HF hardcodes 0.5
    limit = cfg.get("time_step_limit") or (0.0, float("inf"))
    n_layers = int(cfg["num_hidden_layers"])
    attn = tuple(sorted(int(i) for i in (cfg.get("attn_layer_indices") or [])))
    if any(not 0 <= i < n_layers for i in attn):
        raise ValueError(f"attn_layer_indices {list(attn)} out of range for {n_layers} layers")
    if cfg.get("mlp_bias") or cfg.get("attention_bias") or cfg.get("hidden_act", "silu") != "silu":
        raise ValueError("Bamba: only mlp_bias = attention_bias = False and hidden_act = silu are supported")
    return BambaModelConfig(
        **hf_common_fields(cfg, max_position_embeddings=8192),
        intermediate_size=int(cfg["intermediate_size"]), num_hidden_layers=n_layers,
        num_attention_heads=num_heads, num_key_value_heads=int(cfg.get("num_key_value_heads") or num_heads),
        head_dim=head_dim, rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        rope_theta=rope_theta_from_hf(cfg), rope_scaling=rope_scaling_from_hf(cfg),
        num_ssm_heads=ssm_heads, ssm_head_dim=ssm_head_dim, state_size=int(cfg["mamba_d_state"]),
        n_groups=int(cfg.get("mamba_n_groups", 1)), conv_kernel=int(cfg.get("mamba_d_conv", 4)), expand=expand,
        chunk_size=int(cfg.get("mamba_chunk_size", 256)), use_bias=bool(cfg.get("mamba_proj_bias", False)),
        use_conv_bias=bool(cfg.get("mamba_conv_bias", True)),
        time_step_limit=(json_float(limit[0]), json_float(limit[1])),
        attn_layer_indices=attn, rotary_dim=int(head_dim * partial),
    )


def rope_permutation(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """perm[p] = the HF head dim stored at our dim p (see module docstring)."""
    d2, r2 = head_dim // 2, rotary_dim // 2
    passed = list(range(rotary_dim, head_dim))
    split = d2 - r2
    return torch.tensor(list(range(r2)) + passed[:split] + list(range(r2, rotary_dim)) + passed[split:])


class BambaMambaLayer(nn.Module):
    """input_layernorm -> Mamba2Mixer -> residual; pre_ff_layernorm -> gate|up -> silu -> down -> residual."""

    def __init__(self, config: BambaModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        hidden, inter = config.hidden_size, config.intermediate_size
        self.eps, self.intermediate_size = config.rms_norm_eps, inter
        self.input_layernorm = param(hidden, dtype=dtype)
        self.mixer = Mamba2Mixer(config, dtype)
        self.pre_ff_layernorm = param(hidden, dtype=dtype)
        self.gate_up_proj: Any = param(hidden, 2 * inter, dtype=dtype)  # [in, out], as in LlamaDecoderLayer
        self.down_proj: Any = param(inter, hidden, dtype=dtype)

    def forward(self, h: torch.Tensor, state: StateMetadata, conv_state: torch.Tensor,
                ssm_state: torch.Tensor) -> torch.Tensor:
        h = h + self.mixer(rms_norm_rows(h, self.input_layernorm, self.eps), state, conv_state, ssm_state)
        gate, up = linear(rms_norm_rows(h, self.pre_ff_layernorm, self.eps),
                          self.gate_up_proj).split(self.intermediate_size, dim=-1)
        return h + linear(rowwise(F.silu, gate) * up, self.down_proj)

    def pack(self, pack: Callable[[torch.Tensor], Any]) -> None:
        self.mixer.pack(pack)
        pack_weights(self, ("gate_up_proj", "down_proj"), pack)


class BambaForCausalLM(HybridForCausalLM):
    hf_embed_name = "model.embed_tokens.weight"
    hf_norm_name = "model.final_layernorm.weight"

    def __init__(self, config: BambaModelConfig, dtype: torch.dtype = torch.float32) -> None:
        attn = set(config.attn_layer_indices)
        is_attention = [i in attn for i in range(config.num_hidden_layers)]
        super().__init__(config, dtype, (LlamaDecoderLayer(config, dtype) if a else BambaMambaLayer(config, dtype)
                                         for a in is_attention))
        self.is_attention = is_attention
        d, r = config.head_dim, config.rotary_dim
        self.rotary_emb = RotaryEmbedding(d, r, config.rope_theta, config.rope_scaling, dtype)
        self.register_buffer("qk_perm", rope_permutation(d, r), persistent=False)

    def run_layers(self, h: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, kv_caches: list,
                   state: StateMetadata) -> torch.Tensor:
        cos, sin = self.rotary_emb(positions)
        for i, layer in enumerate(self.layers):
            if self.is_attention[i]:
                mlp_out, residual = layer(h, None, cos, sin, meta, kv_caches[i])
                h = mlp_out + residual
            else:
                h = layer(h, state, state.conv[i], state.ssm[i])
        return h

    def weight_targets(self) -> WeightTargets:
        t = super().weight_targets()
        inter = self.config.intermediate_size
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            t[p + "input_layernorm.weight"] = (layer.input_layernorm, layer.input_layernorm)
            ff_norm = layer.post_attention_layernorm if self.is_attention[i] else layer.pre_ff_layernorm
            t[p + "pre_ff_layernorm.weight"] = (ff_norm, ff_norm)
            gu = layer.gate_up_proj
            t[p + "feed_forward.gate_proj.weight"] = (gu, gu.t().narrow(0, 0, inter))
            t[p + "feed_forward.up_proj.weight"] = (gu, gu.t().narrow(0, inter, inter))
            t[p + "feed_forward.down_proj.weight"] = (layer.down_proj, layer.down_proj.t())
            if self.is_attention[i]:
                t.update(layer.attention_weight_targets(p + "self_attn."))
            else:
                t.update(layer.mixer.weight_targets(p + "mamba."))
        return t

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """HF names; q/k rows permuted per head into the RoPE layout; every parameter must be covered."""
        d = self.config.head_dim

        def permute_qk(name: str, w: torch.Tensor) -> torch.Tensor:
            if name.endswith(("q_proj.weight", "k_proj.weight")) and w.dim() == 2:
                return w.reshape(-1, d, w.shape[-1])[:, self.qk_perm].reshape(w.shape)  # HF head dim order -> ours
            return w

        load_named_weights(self, self.weight_targets(), weights, self.lm_head is None, permute_qk)
