"""Qwen3-Next's multi-token-prediction layer as its checkpoints store it: mtp.fc over
[pre_fc_norm_embedding(embed(t)) ; pre_fc_norm_hidden(h)], one full-attention decoder layer with
MoE (mtp.layers.0.*), mtp.norm; the target's embedding and lm_head. The same contract as
models/deepseek_mtp.py, so pyengine/spec_decode/mtp.py drives both: forward returns the state the
next draft chains on (here the normed output, which the lm_head reads directly).
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from pyengine import ops
from pyengine.engine.attention_metadata import AttentionMetadata
from pyengine.models.layers import KVCache, WeightTargets, linear, param

if TYPE_CHECKING:
    from pyengine.models.qwen3_next import Qwen3NextForCausalLM


class Qwen3NextMtp(nn.Module):
    PREFIX = "mtp."

    def __init__(self, target: Qwen3NextForCausalLM, dtype: torch.dtype) -> None:
        from pyengine.models.qwen3_next import Qwen3NextDecoderLayer

        super().__init__()
        cfg = target.config
        hidden = cfg.hidden_size
        self.eps, self.dtype = cfg.rms_norm_eps, dtype
        self.kv_shape = (cfg.num_key_value_heads, cfg.head_dim)
        self.pre_fc_norm_embedding = param(hidden, dtype=dtype)
        self.pre_fc_norm_hidden = param(hidden, dtype=dtype)
        self.fc: torch.Tensor = param(2 * hidden, hidden, dtype=dtype)  # [in, out]
        layer_cfg = dataclasses.replace(cfg, num_hidden_layers=1, layer_types=["full_attention"],
                                        moe_layers=[cfg.moe is not None], load_mtp=False)
        self.layer = Qwen3NextDecoderLayer(layer_cfg, 0, dtype)
        self.norm = param(hidden, dtype=dtype)
        object.__setattr__(self, "target", target)  # a plain reference back: no cycle in the module tree

    def make_kv_cache(self, num_blocks: int, block_size: int, device: torch.device) -> KVCache:
        # Zeros, not empty: positions the layer never wrote may be read (drafts only).
        shape = (num_blocks, block_size, *self.kv_shape)
        return (torch.zeros(shape, dtype=self.dtype, device=device), torch.zeros(shape, dtype=self.dtype, device=device))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, prev_hidden: torch.Tensor,
                meta: AttentionMetadata, kv_cache: KVCache) -> torch.Tensor:
        target: Qwen3NextForCausalLM = self.target  # type: ignore[assignment]
        e = ops.rms_norm(F.embedding(input_ids, target.embed_tokens), self.pre_fc_norm_embedding, self.eps)
        h = ops.rms_norm(prev_hidden.contiguous(), self.pre_fc_norm_hidden, self.eps)
        x = linear(torch.cat([e, h], dim=-1), self.fc)
        cos, sin = target.rotary_emb(positions)
        out, residual = self.layer(x, None, cos, sin, meta, kv_cache, None, 0)
        return ops.fused_add_rms_norm(out, residual, self.norm, self.eps)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.target.compute_logits(hidden)  # type: ignore[operator]

    def weight_targets(self) -> WeightTargets:
        p = self.PREFIX
        t = self.layer.weight_targets(p + "layers.0.")
        t.update({p + "fc.weight": (self.fc, self.fc.t()), p + "norm.weight": (self.norm, self.norm),
                  p + "pre_fc_norm_embedding.weight": (self.pre_fc_norm_embedding, self.pre_fc_norm_embedding),
                  p + "pre_fc_norm_hidden.weight": (self.pre_fc_norm_hidden, self.pre_fc_norm_hidden)})
        return t

    def rearrangers(self) -> dict[str, nn.Module]:
        """Checkpoint prefix -> the module whose rearrange() takes its tensors."""
        return {self.PREFIX + "layers.0.": self.layer.mixer}
