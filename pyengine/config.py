"""Model hyper-parameters, read from a HF config.json dict (the GGUF loader builds the same dict)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


HYBRID_ARCHITECTURES = ("Mamba2ForCausalLM", "BambaForCausalLM", "NemotronHForCausalLM")


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
    def from_hf_dict(cls, cfg: dict[str, Any]) -> "ModelConfig":
        archs = cfg.get("architectures") or []
        if not archs:
            raise ValueError("config.json has no 'architectures' entry")
        arch = str(archs[0])
        if arch == "BambaForCausalLM":  # Mamba2 + attention hybrid: pyengine/models/bamba.py
            from pyengine.models.bamba import bamba_model_config

            return bamba_model_config(cfg)
        if arch == "NemotronHForCausalLM":  # Mamba2 / attention / MLP blocks: pyengine/models/nemotron_h.py
            from pyengine.models.nemotron_h import nemotron_h_model_config

            return nemotron_h_model_config(cfg)
        if arch in HYBRID_ARCHITECTURES:  # SSM hyper-parameters: pyengine/models/mamba2.py
            from pyengine.models.mamba2 import mamba2_model_config

            return mamba2_model_config(cfg)
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        head_dim = cfg.get("head_dim") or hidden // num_heads
        eos = cfg.get("eos_token_id")
        eos_ids = [] if eos is None else [int(e) for e in (eos if isinstance(eos, list) else [eos])]
        # Qwen2 always has q/k/v bias (its config has no attention_bias key); Llama reads the flag.
        attention_bias = bool(cfg.get("attention_bias", arch == "Qwen2ForCausalLM"))
        if arch == "Qwen2ForCausalLM":
            attention_bias = True
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=num_heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(_rope_theta(cfg)),
            rope_scaling=_rope_scaling(cfg),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            qk_norm=arch == "Qwen3ForCausalLM",
            bos_token_id=None if cfg.get("bos_token_id") is None else int(cfg["bos_token_id"]),
            eos_token_ids=eos_ids,
        )


def _rope_theta(cfg: dict[str, Any]) -> float:
    # transformers 5 moved rope_theta into rope_parameters; older configs keep it top-level.
    params = cfg.get("rope_parameters") or {}
    return float(cfg.get("rope_theta") or params.get("rope_theta") or 10000.0)


def _rope_scaling(cfg: dict[str, Any]) -> dict[str, Any] | None:
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    if not scaling:
        return None
    scaling = dict(scaling)
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type in (None, "default"):
        return None
    if rope_type not in ("llama3", "linear"):
        raise ValueError(f"unsupported rope scaling type {rope_type!r} (supported: llama3, linear)")
    scaling["rope_type"] = rope_type
    return scaling
