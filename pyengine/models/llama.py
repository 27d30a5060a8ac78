"""The Llama family (Llama 2/3, SmolLM, Qwen2 with qkv bias, Qwen3 with per-head q/k RMSNorm).

One flat token batch [T] runs through the decoder layers (pyengine.models.layers.LlamaDecoderLayer);
each appends its new K/V to the paged cache and attends over it. Weights are [in, out] (see
docs/models.md for why); a tied lm_head is kept only once, as [hidden, vocab], and token embedding
then gathers its columns.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from pyengine import ops
from pyengine.config import ModelConfig, architecture_of
from pyengine.engine.attention_metadata import AttentionMetadata
from pyengine.models.layers import (KVCache, LlamaDecoderLayer, RotaryEmbedding, cpu_linear_packer, linear,
                                    onednn_prepack, param)
from pyengine.ops.kernel_config import get_kernel_config

if TYPE_CHECKING:
    from pyengine.models.llama_cpu_stack import CpuLlamaStack


def llama_model_config(cfg: dict[str, Any]) -> ModelConfig:
    arch = architecture_of(cfg)
    config = ModelConfig.from_hf_dict(cfg)
    # Qwen2 always has q/k/v bias (its config has no attention_bias key); Qwen3 norms q and k per head.
    config.attention_bias = config.attention_bias or arch == "Qwen2ForCausalLM"
    config.qk_norm = arch == "Qwen3ForCausalLM"
    return config


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        vocab, hidden = config.vocab_size, config.hidden_size
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, dtype) for _ in range(config.num_hidden_layers))
        self.norm = param(hidden, dtype=dtype)
        self.lm_head = param(hidden, vocab, dtype=dtype)  # [in, out]
        # Untied: a row-major [vocab, hidden] table. Tied: None, rows come from lm_head's columns.
        self.embed_tokens = None if config.tie_word_embeddings else param(vocab, hidden, dtype=dtype)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.head_dim, config.rope_theta, config.rope_scaling,
                                          dtype, max_positions=config.max_position_embeddings)
        # Set by prepack_for_cpu: the packed lm_head, and every layer in one C++ call per step.
        self.packed_lm_head: Any = None
        self.cpu_stack: CpuLlamaStack | None = None

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[KVCache],
    ) -> torch.Tensor:
        """input_ids/positions [T] int64 -> final-norm hidden states [T, hidden]."""
        if self.embed_tokens is None:
            h = self.lm_head.index_select(1, input_ids).t().contiguous()
        else:
            h = F.embedding(input_ids, self.embed_tokens)
        cos, sin = self.rotary_emb(positions)  # [T, D], shared by all heads and layers
        stack = self.cpu_stack
        if stack is not None and get_kernel_config().cpu_layer_stack and stack.applies(meta, kv_caches):
            h, residual = stack(h, cos, sin, meta, kv_caches)
        else:
            residual = None
            for layer, kv_cache in zip(self.layers, kv_caches):
                h, residual = layer(h, residual, cos, sin, meta, kv_cache)
        assert residual is not None
        return ops.fused_add_rms_norm(h, residual, self.norm, self.config.rms_norm_eps)[0]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] float32."""
        return linear(hidden, self.lm_logits_weight).float()

    @property
    def lm_logits_weight(self) -> Any:
        return self.lm_head if self.packed_lm_head is None else self.packed_lm_head

    def prepack_for_cpu(self) -> bool:
        """Swap every linear weight for a packed copy (CPU only, after load_weights): on x86-64 CPUs
        with AVX-512 (avx512_bf16 for bf16) or AVX2 + FMA pyengine's own GEMM
        (pyengine.ops.cpu.PackedLinear: batch-invariant), which also runs the C++ layer stack,
        else a oneDNN-prepacked weight. Returns False (model unchanged)
        where neither is available. The dense copies are dropped, so load_weights cannot run again."""
        if self.lm_head.device.type != "cpu":
            return False
        pack = cpu_linear_packer(self.lm_head)
        if pack is None:
            return False
        for layer in self.layers:
            for name in LlamaDecoderLayer.LINEAR_NAMES:
                packed = pack(getattr(layer, name).detach())
                delattr(layer, name)  # drop the Parameter; a plain attribute takes its name
                setattr(layer, name, packed)
        # lm_head stays dense as well when tied: token embedding gathers from it.
        self.packed_lm_head = pack(self.lm_head.detach())
        if self.embed_tokens is not None:
            self.lm_head.data = torch.empty(0, dtype=self.dtype)
        self.owns_cpu_threads = pack is not onednn_prepack  # see ModelRunner.step_threads
        if self.owns_cpu_threads:  # used per step while KernelConfig.cpu_layer_stack is on
            from pyengine.models.llama_cpu_stack import CpuLlamaStack  # needs the extension's CPU ops

            self.cpu_stack = CpuLlamaStack.build(self.layers, self.config, self.dtype)
        return True

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors ([out, in] linears) into the fused, transposed parameters; every
        parameter must be fully covered, else ValueError."""
        cfg = self.config
        hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        inter = cfg.intermediate_size
        # (row offset, row count) of each HF projection inside its fused parameter.
        qkv_rows = {"q_proj": (0, hq * d), "k_proj": (hq * d, hkv * d), "v_proj": ((hq + hkv) * d, hkv * d)}
        gate_up_rows = {"gate_proj": (0, inter), "up_proj": (inter, inter)}
        qk_norm_rows = {"q_norm": (0, hq), "k_norm": (hq, hkv)}
        transposed = {id(self.lm_head)}
        for layer in self.layers:
            transposed.update(id(getattr(layer, name)) for name in LlamaDecoderLayer.LINEAR_NAMES)
        filled: dict[int, int] = {}  # parameter id -> HF rows copied so far

        def put(target: torch.Tensor | None, name: str, src: torch.Tensor, start: int = 0, rows: int | None = None) -> None:
            if target is None:
                raise ValueError(f"checkpoint tensor {name} has no place in this model config")
            hf_view = target.t() if id(target) in transposed else target  # HF [out, in] orientation
            dst = hf_view if rows is None else hf_view.narrow(0, start, rows)
            if tuple(dst.shape) != tuple(src.shape):
                raise ValueError(f"{name}: checkpoint shape {tuple(src.shape)} != expected {tuple(dst.shape)}")
            with torch.no_grad():
                dst.copy_(src)
            filled[id(target)] = filled.get(id(target), 0) + dst.shape[0]

        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq"):
                continue  # derived from the config, never trusted from a file
            parts = name.split(".")
            if name == "model.embed_tokens.weight":
                put(self.lm_head if self.embed_tokens is None else self.embed_tokens, name, tensor)
            elif name == "model.norm.weight":
                put(self.norm, name, tensor)
            elif name == "lm_head.weight":
                if not cfg.tie_word_embeddings:
                    put(self.lm_head, name, tensor)
            elif len(parts) >= 5 and parts[0] == "model" and parts[1] == "layers":
                layer = self.layers[int(parts[2])]
                assert isinstance(layer, LlamaDecoderLayer)
                module, kind = parts[-2], parts[-1]
                if module in qkv_rows:
                    put(layer.qkv_proj if kind == "weight" else layer.qkv_bias, name, tensor, *qkv_rows[module])
                elif module in gate_up_rows:
                    put(layer.gate_up_proj, name, tensor, *gate_up_rows[module])
                elif module in qk_norm_rows:
                    start, rows = qk_norm_rows[module]
                    # One per-head weight [D], repeated for every head of q (or k).
                    put(layer.qk_norm, name, tensor.expand(rows, d), start, rows)
                elif module in ("o_proj", "down_proj", "input_layernorm", "post_attention_layernorm"):
                    put(getattr(layer, module), name, tensor)
                else:
                    raise ValueError(f"unexpected checkpoint tensor {name}")
            else:
                raise ValueError(f"unexpected checkpoint tensor {name}")

        for pname, p in self.named_parameters():
            rows = p.shape[1] if id(p) in transposed else p.shape[0]
            if filled.get(id(p), 0) != rows:
                raise ValueError(f"checkpoint does not cover parameter {pname} ({filled.get(id(p), 0)}/{rows} rows)")
