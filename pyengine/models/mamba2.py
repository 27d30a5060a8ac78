"""Mamba2 (Mamba2ForCausalLM): a stack of Mamba2 mixers over one flat token batch.

Each mixer: in_proj -> [gate z | xBC | dt]; causal depthwise conv over xBC (silu); SSM over
x with B, C (groups), dt (softplus + dt_bias), A = -exp(A_log), skip D; gated group RMSNorm
(y * silu(z)); out_proj. Recurrent state lives in the runner's StateCache (pyengine/state_cache.py):
decode/verify rows (the first num_decode_rows, any T = 1 + drafts) run causal_conv1d_update +
selective_state_update reading slot / offset a - 1; prefill rows run causal_conv1d_fn + the chunked
scan. Without a StateMetadata (a standalone forward) every row is a prefill from zero state.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pyengine.engine.attention_metadata import AttentionMetadata
from pyengine.config import ModelConfig
from pyengine.ops import ssm_reference
from pyengine.engine.state_cache import StateCache, StateMetadata


@dataclass
class Mamba2ModelConfig(ModelConfig):
    """ModelConfig plus the SSM hyper-parameters. The attention fields describe a 1x1 KV cache
    (the scheduler still pages positions in blocks; a pure Mamba2 model never reads them)."""
    num_ssm_heads: int = 0
    ssm_head_dim: int = 0
    state_size: int = 0
    n_groups: int = 1
    conv_kernel: int = 4
    expand: int = 2
    chunk_size: int = 256
    use_bias: bool = False
    use_conv_bias: bool = True
    time_step_limit: tuple[float, float] = (0.0, float("inf"))


def _json_float(v: Any) -> float:
    """transformers writes inf as {"__float__": "Infinity"} in config.json."""
    return float(v["__float__"] if isinstance(v, dict) else v)


def mamba2_model_config(cfg: dict[str, Any]) -> Mamba2ModelConfig:
    eos = cfg.get("eos_token_id")
    hidden = int(cfg["hidden_size"])
    limit = cfg.get("time_step_limit") or (0.0, float("inf"))
    return Mamba2ModelConfig(
        architecture=str(cfg["architectures"][0]), vocab_size=int(cfg["vocab_size"]), hidden_size=hidden,
        intermediate_size=int(cfg.get("expand", 2) * hidden), num_hidden_layers=int(cfg["num_hidden_layers"]),
        num_attention_heads=1, num_key_value_heads=1, head_dim=1,
        rms_norm_eps=float(cfg.get("layer_norm_epsilon", 1e-5)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 8192)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        bos_token_id=None if cfg.get("bos_token_id") is None else int(cfg["bos_token_id"]),
        eos_token_ids=[] if eos is None else [int(e) for e in (eos if isinstance(eos, list) else [eos])],
        num_ssm_heads=int(cfg["num_heads"]), ssm_head_dim=int(cfg["head_dim"]), state_size=int(cfg["state_size"]),
        n_groups=int(cfg.get("n_groups", 1)), conv_kernel=int(cfg.get("conv_kernel", 4)),
        expand=int(cfg.get("expand", 2)), chunk_size=int(cfg.get("chunk_size", 256)),
        use_bias=bool(cfg.get("use_bias", False)), use_conv_bias=bool(cfg.get("use_conv_bias", True)),
        time_step_limit=(_json_float(limit[0]), _json_float(limit[1])),
    )


def ssm_ops(device: torch.device) -> ModuleType:
    """GPU kernels (pyengine.ops.ssm_cuda) for CUDA tensors when built, else the references."""
    if device.type == "cuda":
        try:
            from pyengine.ops import ssm_cuda

            return ssm_cuda
        except ImportError:
            pass
    return ssm_reference


class Mamba2Mixer(nn.Module):
    def __init__(self, cfg: Mamba2ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.state_size = cfg.num_ssm_heads, cfg.ssm_head_dim, cfg.state_size
        self.n_groups, self.width, self.chunk_size = cfg.n_groups, cfg.conv_kernel, cfg.chunk_size
        self.inner = cfg.num_ssm_heads * cfg.ssm_head_dim
        self.conv_dim = self.inner + 2 * cfg.n_groups * cfg.state_size
        self.eps, self.dt_limit = cfg.rms_norm_eps, cfg.time_step_limit

        def param(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)

        self.in_proj = param(self.inner + self.conv_dim + self.num_heads, cfg.hidden_size)  # HF [out, in]
        self.in_proj_bias = param(self.in_proj.shape[0]) if cfg.use_bias else None
        self.conv_weight = param(self.conv_dim, self.width)
        self.conv_bias = param(self.conv_dim) if cfg.use_conv_bias else None
        self.dt_bias = param(self.num_heads)
        self.A_log = param(self.num_heads)
        self.D = param(self.num_heads)
        self.norm = param(self.inner)
        self.out_proj = param(cfg.hidden_size, self.inner)
        self.out_proj_bias = param(cfg.hidden_size) if cfg.use_bias else None

    def state_shape(self, k: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return (self.width - 1 + k, self.conv_dim), (self.num_heads, self.head_dim, self.state_size)

    def forward(self, h: torch.Tensor, state: StateMetadata, conv_state: torch.Tensor,
                ssm_state: torch.Tensor) -> torch.Tensor:
        ops = ssm_ops(h.device)
        t, nd = h.shape[0], state.num_decode_tokens
        gate, xbc, dt = F.linear(h, self.in_proj, self.in_proj_bias).split(
            [self.inner, self.conv_dim, self.num_heads], dim=-1)
        xbc = xbc.contiguous()
        conv_out = torch.empty_like(xbc)
        dec_qsl, dec_idx, dec_acc = state.decode_rows()
        pre_qsl, pre_idx, pre_acc, pre_init = state.prefill_rows()
        if state.num_decode_rows:
            conv_out[:nd] = ops.causal_conv1d_update(xbc[:nd], conv_state, self.conv_weight, self.conv_bias,
                                                     dec_qsl, dec_idx, dec_acc, "silu")
        if nd < t:
            conv_out[nd:] = ops.causal_conv1d_fn(xbc[nd:], conv_state, self.conv_weight, self.conv_bias,
                                                 pre_qsl, pre_idx, pre_acc, pre_init, "silu")
        x, B, C = conv_out.split([self.inner, self.n_groups * self.state_size, self.n_groups * self.state_size], -1)
        x = x.reshape(t, self.num_heads, self.head_dim)
        B = B.reshape(t, self.n_groups, self.state_size)
        C = C.reshape(t, self.n_groups, self.state_size)
        dt = dt.contiguous()
        A = -torch.exp(self.A_log.float())
        y = torch.empty_like(x)
        if state.num_decode_rows:
            y[:nd] = ops.selective_state_update(ssm_state, x[:nd], dt[:nd], A, B[:nd], C[:nd], self.D, None,
                                                self.dt_bias, dec_qsl, dec_idx, dec_acc, True, self.dt_limit)
        if nd < t:
            y[nd:] = ops.ssd_chunk_scan(x[nd:], dt[nd:], A, B[nd:], C[nd:], self.D, None, self.dt_bias, pre_qsl,
                                        ssm_state, pre_idx, pre_acc, pre_init, self.chunk_size, True, self.dt_limit)
        # gated group RMSNorm (HF MambaRMSNormGated, norm_before_gate=False), fp32
        g = y.reshape(t, self.inner).float() * F.silu(gate.float())
        g = g.view(t, self.n_groups, -1)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        g = self.norm * g.view(t, self.inner).to(h.dtype)
        return F.linear(g, self.out_proj, self.out_proj_bias)


class Mamba2ForCausalLM(nn.Module):
    uses_kv_cache = False  # no attention layers: the runner's KV pool is a placeholder

    def __init__(self, config: Mamba2ModelConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config, self.dtype = config, dtype
        hidden = config.hidden_size
        self.embeddings = nn.Parameter(torch.empty(config.vocab_size, hidden, dtype=dtype), requires_grad=False)
        self.layer_norms = nn.ParameterList(
            nn.Parameter(torch.empty(hidden, dtype=dtype), requires_grad=False) for _ in range(config.num_hidden_layers))
        self.mixers = nn.ModuleList(Mamba2Mixer(config, dtype) for _ in range(config.num_hidden_layers))
        self.norm_f = nn.Parameter(torch.empty(hidden, dtype=dtype), requires_grad=False)
        self.lm_head = None if config.tie_word_embeddings else nn.Parameter(
            torch.empty(config.vocab_size, hidden, dtype=dtype), requires_grad=False)

    def state_shapes(self, num_spec_tokens: int) -> list:
        """Per layer (conv row shape, ssm shape): the runner builds a StateCache from this."""
        return [m.state_shape(num_spec_tokens) for m in self.mixers]

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list, state: StateMetadata | None = None) -> torch.Tensor:
        """input_ids [T] -> final-norm hidden [T, hidden]. kv_caches are unused (no attention)."""
        if state is None:
            state = StateCache.scratch(self, meta.query_start_loc, self.dtype, input_ids.device)
        h = F.embedding(input_ids, self.embeddings)
        eps = self.config.rms_norm_eps
        for i, (norm, mixer) in enumerate(zip(self.layer_norms, self.mixers)):
            h = h + mixer(F.rms_norm(h, (h.shape[-1],), norm, eps), state, state.conv[i], state.ssm[i])
        return F.rms_norm(h, (h.shape[-1],), self.norm_f, eps)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.embeddings if self.lm_head is None else self.lm_head).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """HF names (backbone.*, lm_head.weight); every parameter must be covered, else ValueError."""
        targets: dict[str, torch.Tensor | None] = {"backbone.embeddings.weight": self.embeddings,
                                                   "backbone.norm_f.weight": self.norm_f,
                                                   "lm_head.weight": self.lm_head}
        names = {"in_proj.weight": "in_proj", "in_proj.bias": "in_proj_bias", "conv1d.weight": "conv_weight",
                 "conv1d.bias": "conv_bias", "dt_bias": "dt_bias", "A_log": "A_log", "D": "D",
                 "norm.weight": "norm", "out_proj.weight": "out_proj", "out_proj.bias": "out_proj_bias"}
        for i, mixer in enumerate(self.mixers):
            targets[f"backbone.layers.{i}.norm.weight"] = self.layer_norms[i]
            for hf, ours in names.items():
                targets[f"backbone.layers.{i}.mixer.{hf}"] = getattr(mixer, ours)
        filled: set[int] = set()
        for name, tensor in weights:
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied
            target = targets.get(name)
            if target is None:
                raise ValueError(f"unexpected checkpoint tensor {name}")
            src = tensor.flatten(1) if name.endswith("conv1d.weight") else tensor  # [dim, 1, W] -> [dim, W]
            if tuple(src.shape) != tuple(target.shape):
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != expected {tuple(target.shape)}")
            with torch.no_grad():
                target.copy_(src)
            filled.add(id(target))
        for pname, p in self.named_parameters():
            if id(p) not in filled:
                raise ValueError(f"checkpoint does not cover parameter {pname}")
