"""The EAGLE-3 head of pyengine/models/eagle3.py in differentiable torch, for training
(scripts/train_eagle3.py): padded batches [B, T], and EAGLE-3's training-time test, which unrolls
the head on its own outputs with the attention the proposer's KV cache gives each chained draft;
saving to and loading from the HF layout the engine loads.

A chained step j at position p reads the token x_{p+1} and the step before's output at p - 1, and
attends to step 0's keys at positions <= p - j (the proposer's catch-up over real features) and to
step i's key at p - j + i for i = 1..j (its chain). tests/test_eagle3.py checks the unrolled logits
against the proposer's drafts.
"""
from __future__ import annotations

import json
import math
import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pyengine.models.layers import RotaryEmbedding


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on pairs (j, j + d/2) with RotaryEmbedding's cos / sin (rotate_half's sign is in sin),
    as pyengine's rope_and_cache applies them. x [B, heads, T, d]."""
    a, b = x.chunk(2, dim=-1)
    return x * cos + torch.cat([b, a], dim=-1) * sin


class TrainHead(nn.Module):
    """The head of pyengine/models/eagle3.py in differentiable torch, over padded batches [B, T]."""

    def __init__(self, c: dict[str, Any], embed: torch.Tensor) -> None:
        super().__init__()
        H, heads, kv, d, inter = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"], \
            c["intermediate_size"]
        self.c, self.eps, self.heads, self.kv, self.d = c, c["rms_norm_eps"], heads, kv, d
        self.fc = nn.Linear(len(c["eagle_aux_hidden_state_layer_ids"]) * c["target_hidden_size"], H, bias=False)
        self.q_proj, self.k_proj = nn.Linear(2 * H, heads * d, bias=False), nn.Linear(2 * H, kv * d, bias=False)
        self.v_proj, self.o_proj = nn.Linear(2 * H, kv * d, bias=False), nn.Linear(heads * d, H, bias=False)
        self.gate_proj, self.up_proj = nn.Linear(H, inter, bias=False), nn.Linear(H, inter, bias=False)
        self.down_proj, self.lm_head = nn.Linear(inter, H, bias=False), nn.Linear(H, c["draft_vocab_size"], bias=False)
        self.input_layernorm, self.hidden_norm, self.post_attention_layernorm, self.norm = (
            nn.Parameter(torch.ones(H)) for _ in range(4))
        self.register_buffer("embed", embed, persistent=False)  # the target's token embedding, frozen
        self.rope = RotaryEmbedding(d, d, c["rope_theta"], c.get("rope_scaling"), torch.float32)
        for w in (self.o_proj.weight, self.down_proj.weight):
            nn.init.normal_(w, std=0.02 / math.sqrt(2))

    def unroll(self, tokens: torch.Tensor, aux: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """tokens [B, T] (x_{p+1} at position p), aux [B, T, n_aux * target_hidden] (at p) -> the
        draft-vocabulary logits of each step j [B, T, Vd]; step j's row p is the head at position
        p after j chained steps (valid for p >= j)."""
        B, T = tokens.shape
        cos, sin = (t.to(aux.dtype) for t in self.rope(torch.arange(T, device=tokens.device)))  # bf16 on CUDA
        e = rms(F.embedding(tokens, self.embed).to(aux.dtype), self.input_layernorm, self.eps)
        g = self.fc(aux)
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        rep = self.heads // self.kv
        out_logits = []
        for j in range(steps):
            x = torch.cat([e, rms(g, self.hidden_norm, self.eps)], dim=-1)
            q = rotate(self.q_proj(x).view(B, T, self.heads, self.d).transpose(1, 2), cos, sin)
            keys.append(rotate(self.k_proj(x).view(B, T, self.kv, self.d).transpose(1, 2), cos, sin))
            values.append(self.v_proj(x).view(B, T, self.kv, self.d).transpose(1, 2))
            # step j at p attends to step 0 at positions <= p - j and to step i at p - j + i (its chain)
            ks = [keys[0]] + [F.pad(keys[i], (0, 0, j - i, 0))[:, :, :T] for i in range(1, j + 1)]
            vs = [values[0]] + [F.pad(values[i], (0, 0, j - i, 0))[:, :, :T] for i in range(1, j + 1)]
            k = torch.cat(ks, dim=2).repeat_interleave(rep, dim=1)
            v = torch.cat(vs, dim=2).repeat_interleave(rep, dim=1)
            attn = F.scaled_dot_product_attention(q, k, v, attn_mask=_ttt_mask(T, j, tokens.device))
            r = g + self.o_proj(attn.transpose(1, 2).reshape(B, T, self.heads * self.d))
            h = rms(r, self.post_attention_layernorm, self.eps)
            out = self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h)) + r
            out_logits.append(self.lm_head(rms(out, self.norm, self.eps)))
            g = F.pad(out, (0, 0, 1, 0))[:, :T]  # step j + 1 at p reads this step's output at p - 1
        return out_logits


_MASKS: dict[tuple[int, int, str], torch.Tensor] = {}


def _ttt_mask(T: int, j: int, device: torch.device) -> torch.Tensor:
    key = (T, j, str(device))
    if key not in _MASKS:
        p = torch.arange(T, device=device)
        blocks = [p[None, :] <= p[:, None] - j] + [torch.eye(T, dtype=torch.bool, device=device)] * j
        _MASKS[key] = torch.cat(blocks, dim=1)
    return _MASKS[key]


# TrainHead attribute -> its tensor in the HF layout (pyengine/models/eagle3.py)
HF_NAMES = {"fc": "fc.weight", "q_proj": "midlayer.self_attn.q_proj.weight", "k_proj": "midlayer.self_attn.k_proj.weight",
            "v_proj": "midlayer.self_attn.v_proj.weight", "o_proj": "midlayer.self_attn.o_proj.weight",
            "gate_proj": "midlayer.mlp.gate_proj.weight", "up_proj": "midlayer.mlp.up_proj.weight",
            "down_proj": "midlayer.mlp.down_proj.weight", "lm_head": "lm_head.weight",
            "input_layernorm": "midlayer.input_layernorm.weight", "hidden_norm": "midlayer.hidden_norm.weight",
            "post_attention_layernorm": "midlayer.post_attention_layernorm.weight", "norm": "norm.weight"}


def _tensor_of(head: TrainHead, attr: str) -> torch.Tensor:
    m = getattr(head, attr)
    return m.weight if isinstance(m, nn.Linear) else m


def load_head(path: str, embed: torch.Tensor) -> TrainHead:
    """A saved head back as a TrainHead (fp32): to check it against pyengine's, or to go on training."""
    from safetensors.torch import load_file

    with open(os.path.join(path, "config.json")) as f:
        head = TrainHead(json.load(f), embed)
    weights = load_file(os.path.join(path, "model.safetensors"))
    with torch.no_grad():
        for attr, name in HF_NAMES.items():
            _tensor_of(head, attr).copy_(weights[name].float())
    return head


def save_head(head: TrainHead, ids: torch.Tensor, vocab: int, out: str) -> int:
    from safetensors.torch import save_file

    os.makedirs(out, exist_ok=True)
    tensors = {name: _tensor_of(head, attr).detach().to("cpu", torch.bfloat16).contiguous()
               for attr, name in HF_NAMES.items()}
    tensors["d2t"] = ids - torch.arange(len(ids))
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    tensors["t2d"] = t2d
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(head.c, f, indent=2)
    return os.path.getsize(os.path.join(out, "model.safetensors"))


def head_config(target: Any, layers: tuple[int, ...], draft_vocab: int, intermediate: int | None) -> dict[str, Any]:
    c = target.config
    return {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": c.hidden_size,
            "intermediate_size": intermediate or c.intermediate_size, "num_attention_heads": c.num_attention_heads,
            "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim, "num_hidden_layers": 1,
            "vocab_size": c.vocab_size, "draft_vocab_size": draft_vocab, "target_hidden_size": c.hidden_size,
            "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta, "max_position_embeddings": c.max_position_embeddings,
            "tie_word_embeddings": False, "torch_dtype": "bfloat16", "eagle_aux_hidden_state_layer_ids": list(layers),
            **({"rope_scaling": c.rope_scaling} if c.rope_scaling else {})}


def init_from_target(head: TrainHead, target: Any, ids: torch.Tensor) -> None:
    """lm_head starts as the target's output rows of the draft vocabulary (its token embedding when
    tied), norm as the target's final norm: the head's last step then resembles the target's."""
    with torch.no_grad():
        rows = head.embed[ids.to(head.embed.device)] if target.config.tie_word_embeddings else None
        lm = getattr(target, "lm_head", None)
        if rows is None and isinstance(lm, torch.Tensor) and lm.numel():
            rows = lm.t()[ids.to(lm.device)]
        if rows is not None:
            head.lm_head.weight.copy_(rows.float())
        head.norm.copy_(target.norm.float())
