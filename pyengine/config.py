"""Model hyper-parameters and the HF config.json fields every architecture reads the same way.

Each model file builds its own config from the HF dict (pyengine.models.registry picks the builder
by `architectures`); this module knows no model, so the models can import it freely.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # None, or {"rope_type": "llama3"|"linear"|"default", "factor": ..., ...} (HF spelling).
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        """The decoder fields in the Llama family's spelling. Architecture-specific builders start
        here; pyengine.models.model_config_from_hf picks the one for cfg's architecture."""
        num_heads = hf_int(cfg, "num_attention_heads")
        hidden = hf_int(cfg, "hidden_size")
        if num_heads <= 0:
            raise ValueError(f"num_attention_heads must be positive, got {num_heads}")
        return cls(
            **hf_common_fields(cfg, max_position_embeddings=2048),
            intermediate_size=hf_int(cfg, "intermediate_size"),
            num_hidden_layers=hf_int(cfg, "num_hidden_layers"),
            num_attention_heads=num_heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta_from_hf(cfg),
            rope_scaling=rope_scaling_from_hf(cfg),
            attention_bias=bool(cfg.get("attention_bias", False)),
        )


    def kv_elements_per_token(self) -> int:
        """Cache values one token occupies over all layers: K and V of every kv head."""
        return self.num_hidden_layers * 2 * self.num_key_value_heads * self.head_dim

    def validate(self) -> None:
        """Refuse sizes no model can have (a negative hidden_size, zero heads, ...) with a ValueError
        naming the field, before any tensor is allocated from them."""
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= _MAX_SIZE:
                raise ValueError(f"{name} must be an int in 1..{_MAX_SIZE}, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})")
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        if self.bos_token_id is not None and self.bos_token_id < 0:
            raise ValueError(f"bos_token_id must be >= 0, got {self.bos_token_id}")
        if any(e < 0 for e in self.eos_token_ids):
            raise ValueError(f"eos_token_id must be >= 0, got {self.eos_token_ids}")


_MAX_SIZE = 2**31 - 1  # every size reaches int32 kernels and scheduler fields


@dataclass
class Mamba2ModelConfig(ModelConfig):
    """ModelConfig plus the hyper-parameters of the Mamba2 mixer (pyengine.models.layers)."""
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


    def validate(self) -> None:
        super().validate()
        for name in ("num_ssm_heads", "ssm_head_dim", "state_size", "n_groups", "conv_kernel", "chunk_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= _MAX_SIZE:
                raise ValueError(f"{name} must be an int in 1..{_MAX_SIZE}, got {value!r}")


def architecture_of(cfg: dict[str, Any]) -> str:
    if not isinstance(cfg, dict):
        raise ValueError(f"config.json must hold a JSON object, got a {type(cfg).__name__}")
    archs = cfg.get("architectures") or []
    if not isinstance(archs, list) or not archs or not isinstance(archs[0], str):
        raise ValueError("config.json has no 'architectures' entry (a list naming the model class)")
    return archs[0]


def hf_int(cfg: dict[str, Any], key: str, default: Any = None) -> int:
    """An integer field of config.json: KeyError when it is missing and has no default, ValueError
    naming it when it is not an integer."""
    value = cfg[key] if default is None else cfg.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
        raise ValueError(f"{key!r} must be an integer, got {value!r}")
    return int(value)


def hf_common_fields(cfg: dict[str, Any], max_position_embeddings: int) -> dict[str, Any]:
    """ModelConfig fields every architecture spells alike (max_position_embeddings: the default)."""
    eos = cfg.get("eos_token_id")
    return dict(
        architecture=architecture_of(cfg),
        vocab_size=hf_int(cfg, "vocab_size"),
        hidden_size=hf_int(cfg, "hidden_size"),
        max_position_embeddings=hf_int(cfg, "max_position_embeddings", max_position_embeddings),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        bos_token_id=None if cfg.get("bos_token_id") is None else int(cfg["bos_token_id"]),
        eos_token_ids=[] if eos is None else [int(e) for e in (eos if isinstance(eos, list) else [eos])],
    )


def json_float(v: Any) -> float:
    """transformers writes inf as {"__float__": "Infinity"} in config.json."""
    return float(v["__float__"] if isinstance(v, dict) else v)


def rope_theta_from_hf(cfg: dict[str, Any]) -> float:
    # transformers 5 moved rope_theta into rope_parameters; older configs keep it top-level.
    params = cfg.get("rope_parameters") or {}
    return float(cfg.get("rope_theta") or params.get("rope_theta") or 10000.0)


def rope_scaling_from_hf(cfg: dict[str, Any]) -> dict[str, Any] | None:
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    if not scaling:
        return None
    scaling = dict(scaling)
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type in (None, "default"):
        return None
    if rope_type not in ("llama3", "linear", "yarn"):
        raise ValueError(f"unsupported rope scaling type {rope_type!r} (supported: llama3, linear, yarn)")
    scaling["rope_type"] = rope_type
    return scaling
