"""Bamba (BambaForCausalLM): Mamba2 mixers and attention layers interleaved (HF attn_layer_indices).

Every layer is pre-norm: h += mixer(input_layernorm(h)); h += MLP(pre_ff_layernorm(h)), where the
mixer is a Mamba2 mixer (pyengine/models/mamba2.py, state in the runner's StateCache) or GQA
attention over the paged KV cache. An attention layer is exactly a LlamaDecoderLayer
(pyengine/models/llama.py: pre_ff_layernorm is its post_attention_layernorm; gate|up -> silu -> down),
so it is reused as is; a Mamba layer pairs the shared Mamba2Mixer with the same MLP.

Partial RoPE (Bamba: partial_rotary_factor 0.5): HF rotates the first r of the d head dims as
rotate_half pairs (j, j + r/2). The Llama layer rotates pairs (j, j + d/2) over the whole head, so the
q and k rows of every head are permuted at load time to put HF's pair (j, j + r/2) at (j, j + d/2)
and the pass-through dims elsewhere; their cos is 1 and sin 0. q.k is invariant under one
permutation applied to both, and v / o_proj are untouched, so the output equals HF's.

KV cache: the runner allocates one (K, V) pair per layer (kv_caches[i] for layer i); only attention
layers read or write theirs, the Mamba layers' pairs are unused (waste: num_mamba_layers / num_layers
of the KV budget). State: state_shapes() is None for attention layers (no conv / SSM tensors).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pyengine.engine.attention_metadata import AttentionMetadata
from pyengine.config import _rope_scaling, _rope_theta
from pyengine.models.llama import LlamaDecoderLayer, _inv_freq, linear
from pyengine.models.mamba2 import Mamba2Mixer, Mamba2ModelConfig, _json_float
from pyengine.engine.state_cache import StateCache, StateMetadata


@dataclass
class BambaModelConfig(Mamba2ModelConfig):
    """Mamba2ModelConfig (SSM fields) whose attention fields are real, plus the layer pattern."""
    attn_layer_indices: tuple[int, ...] = ()
    rotary_dim: int = 0  # leading head dims rotated by RoPE (head_dim * partial_rotary_factor)


def bamba_model_config(cfg: dict[str, Any]) -> BambaModelConfig:
    eos = cfg.get("eos_token_id")
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
        architecture=str(cfg["architectures"][0]), vocab_size=int(cfg["vocab_size"]), hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]), num_hidden_layers=n_layers,
        num_attention_heads=num_heads, num_key_value_heads=int(cfg.get("num_key_value_heads") or num_heads),
        head_dim=head_dim, rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        rope_theta=float(_rope_theta(cfg)), rope_scaling=_rope_scaling(cfg),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 8192)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        bos_token_id=None if cfg.get("bos_token_id") is None else int(cfg["bos_token_id"]),
        eos_token_ids=[] if eos is None else [int(e) for e in (eos if isinstance(eos, list) else [eos])],
        num_ssm_heads=ssm_heads, ssm_head_dim=ssm_head_dim, state_size=int(cfg["mamba_d_state"]),
        n_groups=int(cfg.get("mamba_n_groups", 1)), conv_kernel=int(cfg.get("mamba_d_conv", 4)), expand=expand,
        chunk_size=int(cfg.get("mamba_chunk_size", 256)), use_bias=bool(cfg.get("mamba_proj_bias", False)),
        use_conv_bias=bool(cfg.get("mamba_conv_bias", True)),
        time_step_limit=(_json_float(limit[0]), _json_float(limit[1])),
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

        def param(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)

        hidden, inter = config.hidden_size, config.intermediate_size
        self.eps, self.intermediate_size = config.rms_norm_eps, inter
        self.input_layernorm = param(hidden)
        self.mixer = Mamba2Mixer(config, dtype)
        self.pre_ff_layernorm = param(hidden)
        self.gate_up_proj = param(hidden, 2 * inter)  # [in, out], as in LlamaDecoderLayer
        self.down_proj = param(inter, hidden)

    def forward(self, h: torch.Tensor, state: StateMetadata, conv_state: torch.Tensor,
                ssm_state: torch.Tensor) -> torch.Tensor:
        h = h + self.mixer(F.rms_norm(h, (h.shape[-1],), self.input_layernorm, self.eps), state, conv_state, ssm_state)
        gate, up = linear(F.rms_norm(h, (h.shape[-1],), self.pre_ff_layernorm, self.eps),
                          self.gate_up_proj).split(self.intermediate_size, dim=-1)
        return h + linear(F.silu(gate) * up, self.down_proj)


class BambaForCausalLM(nn.Module):
    def __init__(self, config: BambaModelConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config, self.dtype = config, dtype
        vocab, hidden = config.vocab_size, config.hidden_size
        attn = set(config.attn_layer_indices)
        self.is_attention = [i in attn for i in range(config.num_hidden_layers)]
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, dtype) if a else BambaMambaLayer(config, dtype)
                                    for a in self.is_attention)
        self.embed_tokens = nn.Parameter(torch.empty(vocab, hidden, dtype=dtype), requires_grad=False)
        self.final_layernorm = nn.Parameter(torch.empty(hidden, dtype=dtype), requires_grad=False)
        self.lm_head = None if config.tie_word_embeddings else nn.Parameter(
            torch.empty(vocab, hidden, dtype=dtype), requires_grad=False)
        d, r = config.head_dim, config.rotary_dim
        if r % 2 or r > d or r <= 0:
            raise ValueError(f"rotary dim {r} must be even and in (0, head_dim={d}]")
        self.register_buffer("inv_freq", _inv_freq(dataclasses.replace(config, head_dim=r)), persistent=False)
        self.register_buffer("qk_perm", rope_permutation(d, r), persistent=False)

    def state_shapes(self, num_spec_tokens: int) -> list:
        """Per layer (conv row shape, ssm shape), None for attention layers: the runner's StateCache."""
        return [None if a else layer.mixer.state_shape(num_spec_tokens)
                for a, layer in zip(self.is_attention, self.layers)]

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, head_dim] in the permuted layout, rotate_half's sign folded into sin."""
        d, r2 = self.config.head_dim, self.config.rotary_dim // 2
        angles = positions.to(torch.float64)[:, None] * self.inv_freq  # [T, r/2]
        cos = torch.ones(positions.shape[0], d, dtype=torch.float64, device=positions.device)
        sin = torch.zeros_like(cos)
        c, s = angles.cos(), angles.sin()
        cos[:, :r2], cos[:, d // 2:d // 2 + r2] = c, c
        sin[:, :r2], sin[:, d // 2:d // 2 + r2] = -s, s
        return cos.to(self.dtype), sin.to(self.dtype)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list, state: StateMetadata | None = None) -> torch.Tensor:
        """input_ids/positions [T] -> final-norm hidden [T, hidden]; kv_caches[i] for attention layer i."""
        if state is None:
            state = StateCache.scratch(self, meta.query_start_loc, self.dtype, input_ids.device)
        h = F.embedding(input_ids, self.embed_tokens)
        cos, sin = self._rope(positions)
        for i, layer in enumerate(self.layers):
            if self.is_attention[i]:
                mlp_out, residual = layer(h, None, cos, sin, meta, kv_caches[i])
                h = mlp_out + residual
            else:
                h = layer(h, state, state.conv[i], state.ssm[i])
        return F.rms_norm(h, (h.shape[-1],), self.final_layernorm, self.config.rms_norm_eps)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.embed_tokens if self.lm_head is None else self.lm_head).float()

    def _targets(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """HF name -> (parameter, destination view in HF orientation [out, in])."""
        cfg = self.config
        hq, hkv, d, inter = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size
        t: dict[str, tuple[torch.Tensor, torch.Tensor]] = {
            "model.embed_tokens.weight": (self.embed_tokens, self.embed_tokens),
            "model.final_layernorm.weight": (self.final_layernorm, self.final_layernorm)}
        if self.lm_head is not None:
            t["lm_head.weight"] = (self.lm_head, self.lm_head)
        mixer_names = {"in_proj.weight": "in_proj", "in_proj.bias": "in_proj_bias", "conv1d.weight": "conv_weight",
                       "conv1d.bias": "conv_bias", "dt_bias": "dt_bias", "A_log": "A_log", "D": "D",
                       "norm.weight": "norm", "out_proj.weight": "out_proj", "out_proj.bias": "out_proj_bias"}
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
                qkv = layer.qkv_proj.t()
                t[p + "self_attn.q_proj.weight"] = (layer.qkv_proj, qkv.narrow(0, 0, hq * d))
                t[p + "self_attn.k_proj.weight"] = (layer.qkv_proj, qkv.narrow(0, hq * d, hkv * d))
                t[p + "self_attn.v_proj.weight"] = (layer.qkv_proj, qkv.narrow(0, (hq + hkv) * d, hkv * d))
                t[p + "self_attn.o_proj.weight"] = (layer.o_proj, layer.o_proj.t())
            else:
                for hf, ours in mixer_names.items():
                    param = getattr(layer.mixer, ours)
                    if param is not None:
                        t[p + "mamba." + hf] = (param, param)
        return t

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """HF names; every parameter must be covered exactly, else ValueError."""
        load_hf_weights(self, self._targets(), weights, self.lm_head is None, self.qk_perm, self.config.head_dim)


def load_hf_weights(model: nn.Module, targets: dict[str, tuple[torch.Tensor, torch.Tensor]],
                    weights: Iterable[tuple[str, torch.Tensor]], tied: bool, qk_perm: torch.Tensor, d: int) -> None:
    """Copy HF-named tensors into `targets` (name -> (parameter, destination view [out, in])); q/k rows
    permuted per head by qk_perm; every target and every parameter of `model` must be covered."""
    seen: set[str] = set()
    for name, tensor in weights:
        if (name == "lm_head.weight" and tied) or name.endswith("rotary_emb.inv_freq"):
            continue
        if name not in targets:
            raise ValueError(f"unexpected checkpoint tensor {name}")
        _, dst = targets[name]
        src = tensor.flatten(1) if name.endswith("conv1d.weight") else tensor  # [dim, 1, W] -> [dim, W]
        if name.endswith(("q_proj.weight", "k_proj.weight")) and src.dim() == 2:
            src = src.reshape(-1, d, src.shape[-1])[:, qk_perm].reshape(src.shape)  # HF head dim order -> ours
        if tuple(src.shape) != tuple(dst.shape):
            raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != expected {tuple(dst.shape)}")
        with torch.no_grad():
            dst.copy_(src)
        seen.add(name)
    missing = sorted(set(targets) - seen)
    if missing:
        raise ValueError(f"checkpoint does not cover {missing[:4]}{' ...' if len(missing) > 4 else ''}")
    covered = {id(p) for p, _ in targets.values()}
    for pname, p in model.named_parameters():
        if id(p) not in covered and p.numel():
            raise ValueError(f"checkpoint does not cover parameter {pname}")
