"""DeepSeek-V3's multi-token-prediction layer, as its checkpoints store it: `model.layers.{N}` with
N = num_hidden_layers holds enorm, hnorm, eh_proj, a full decoder layer (MLA + MoE),
shared_head.norm, shared_head.head and embed_tokens (the last two fall back to the target's when
absent). Only the first of num_nextn_predict_layers layers is used; drafts past the first run it
again on its own output (pyengine/spec_decode/mtp.py).

For the token t at position p and the hidden state h that came before it (the target's final-norm
hidden state at p - 1, or this layer's own output for a draft):
    x = eh_proj([enorm(embed(t)) ; hnorm(h)]);  out = decoder_layer(x) (+ residual)
    logits = shared_head.head(shared_head.norm(out))
The layer's latent cache has the target's block geometry and is indexed by the same slots.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from pyengine import ops
from pyengine.engine.attention_metadata import AttentionMetadata
from pyengine.models.layers import WeightTargets, linear, pack_weights, param

if TYPE_CHECKING:
    from pyengine.models.deepseek_v3 import DeepseekV3ForCausalLM, MlaAttention


class DeepseekMtp(nn.Module):
    def __init__(self, target: DeepseekV3ForCausalLM, dtype: torch.dtype) -> None:
        from pyengine.models.deepseek_v3 import DeepseekV3DecoderLayer

        super().__init__()
        cfg = target.config
        hidden = cfg.hidden_size
        self.layer_index = cfg.num_hidden_layers
        self.prefix = f"model.layers.{self.layer_index}."
        self.eps, self.dtype = cfg.rms_norm_eps, dtype
        self.width = cfg.kv_lora_rank + cfg.qk_rope_head_dim
        self.enorm = param(hidden, dtype=dtype)
        self.hnorm = param(hidden, dtype=dtype)
        self.eh_proj: Any = param(2 * hidden, hidden, dtype=dtype)  # [in, out]: [embedding ; hidden] -> hidden
        self.layer = DeepseekV3DecoderLayer(cfg, self.layer_index, dtype)
        self.shared_head_norm = param(hidden, dtype=dtype)
        # Own embedding / head when the checkpoint has them (take_optional), else the target's.
        self.embed_tokens: torch.Tensor | None
        self.head: Any
        self.register_buffer("embed_tokens", None, persistent=False)
        self.register_buffer("head", None, persistent=False)
        # The target holds this module; a plain reference back (not a submodule: no cycle in the tree).
        object.__setattr__(self, "target", target)

    def make_kv_cache(self, num_blocks: int, block_size: int, device: torch.device) -> torch.Tensor:
        # Zeros, not empty: a prefix-cache hit reads positions this layer never wrote (drafts only).
        return torch.zeros(num_blocks, block_size, self.width, dtype=self.dtype, device=device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, prev_hidden: torch.Tensor,
                meta: AttentionMetadata, kv_cache: torch.Tensor) -> torch.Tensor:
        """Tokens [T] at positions [T] with the hidden states before them [T, hidden] -> this
        layer's output [T, hidden] (the next draft's prev_hidden; compute_logits gives its logits)."""
        target: DeepseekV3ForCausalLM = self.target  # type: ignore[assignment]
        embed = self.embed_tokens if self.embed_tokens is not None else target.embed_tokens
        e = ops.rms_norm(F.embedding(input_ids, embed), self.enorm, self.eps)
        h = ops.rms_norm(prev_hidden.contiguous(), self.hnorm, self.eps)
        x = linear(torch.cat([e, h], dim=-1), self.eh_proj)
        out, residual = self.layer(x, None, positions, target.rope, meta, kv_cache)
        return out + residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        target: DeepseekV3ForCausalLM = self.target  # type: ignore[assignment]
        head = self.head if self.head is not None else target.lm_head
        return linear(ops.rms_norm(hidden, self.shared_head_norm, self.eps), head).float()

    def weight_targets(self) -> WeightTargets:
        p = self.prefix
        targets = self.layer.weight_targets(p)
        targets.update({p + "enorm.weight": (self.enorm, self.enorm), p + "hnorm.weight": (self.hnorm, self.hnorm),
                        p + "eh_proj.weight": (self.eh_proj, self.eh_proj.t()),
                        p + "shared_head.norm.weight": (self.shared_head_norm, self.shared_head_norm)})
        return targets

    def kv_b_layers(self) -> dict[str, MlaAttention]:
        return {self.prefix + "self_attn.kv_b_proj.weight": self.layer.self_attn}

    def take_optional(self, name: str, tensor: torch.Tensor) -> bool:
        """Keep the layer's own embed_tokens / shared_head.head; True if name was one of them."""
        if name == self.prefix + "embed_tokens.weight":
            self.embed_tokens = tensor.to(self.dtype).contiguous()
        elif name == self.prefix + "shared_head.head.weight":
            self.head = tensor.to(self.dtype).t().contiguous()  # [in, out]
        else:
            return False
        return True

    def pack(self, pack: Callable[[torch.Tensor], Any], pack_router: Callable[[torch.Tensor], Any] | None) -> None:
        self.layer.pack(pack, pack_router)
        pack_weights(self, ("eh_proj", "head"), pack)
