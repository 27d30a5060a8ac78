"""An EAGLE-3 draft head, loaded from the HF layout vLLM and SGLang read: config.json (architectures
like LlamaForCausalLMEagle3; draft_vocab_size, target_hidden_size, optionally
eagle_aux_hidden_state_layer_ids and norm_before_residual) and safetensors with

    fc.weight                         [hidden, n_aux * target_hidden]   fuses the target's aux states
    midlayer.input_layernorm.weight   [hidden]                          on the token embedding
    midlayer.hidden_norm.weight       [hidden]                          on the hidden state
    midlayer.self_attn.{q,k,v}_proj   [.., 2 * hidden]                  over [embedding ; hidden]
    midlayer.self_attn.o_proj, midlayer.post_attention_layernorm, midlayer.mlp.{gate,up,down}_proj
    norm.weight [hidden], lm_head.weight [draft_vocab, hidden]
    d2t [draft_vocab] (int offsets: draft id i is target id i + d2t[i]), t2d [vocab] (bool; unused)
    embed_tokens.weight [vocab, hidden] (optional: else the target's embedding)

("layers.0." is accepted for "midlayer.", and a leading "model." is dropped.) The aux states are the
target's residual stream at the input of layers eagle_aux_hidden_state_layer_ids, by default
(2, L // 2, L - 3) as vLLM picks them (LlamaForCausalLM.set_aux_layers keeps them).

For the token t at position p and the hidden state g before it (fc of the target's aux states at
p - 1, or the head's own previous output for a chained draft):
    x = [input_layernorm(embed(t)) ; hidden_norm(g)];  r = g (hidden_norm(g) if norm_before_residual)
    a = o_proj(attention(x));  r += a;  out = mlp(post_attention_layernorm(r)) + r
The output (pre-norm) is the next draft's g; compute_logits(out) = lm_head(norm(out)) scattered into
the target's vocabulary (-inf elsewhere). The head's one KV cache shares the target's block tables.
"""
from __future__ import annotations

import os
from typing import Any, Callable

import torch
from safetensors import safe_open
from torch import nn

from pyengine import ops
from pyengine.config import ModelConfig
from pyengine.engine.attention_metadata import AttentionMetadata
from pyengine.models.layers import (KVCache, LlamaDecoderLayer, RotaryEmbedding, cpu_linear_packer, linear,
                                    pack_weights, param)
from pyengine.ops.kernel_config import get_kernel_config

LINEARS = ("fc", "lm_head")  # the head's own linears besides the decoder layer's


class Eagle3Head(nn.Module):
    def __init__(self, config: ModelConfig, target: nn.Module, aux_layers: tuple[int, ...], target_hidden: int,
                 draft_vocab: int, norm_before_residual: bool, dtype: torch.dtype) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.config, self.dtype, self.eps = config, dtype, config.rms_norm_eps
        self.aux_layers, self.norm_before_residual = aux_layers, norm_before_residual
        self.fc: Any = param(len(aux_layers) * target_hidden, hidden, dtype=dtype)  # [in, out]
        self.layer = LlamaDecoderLayer(config, dtype)
        hq, hkv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.layer.qkv_proj = param(2 * hidden, (hq + 2 * hkv) * d, dtype=dtype)  # [embedding ; hidden] in
        self.hidden_norm = param(hidden, dtype=dtype)
        self.norm = param(hidden, dtype=dtype)
        self.lm_head: Any = param(hidden, draft_vocab, dtype=dtype)
        self.embed_tokens: torch.Tensor | None
        self.register_buffer("embed_tokens", None, persistent=False)  # own table, when the checkpoint has one
        self.register_buffer("target_ids", torch.arange(draft_vocab), persistent=False)  # draft id -> target id
        self.identity_vocab = draft_vocab == config.vocab_size  # and no d2t that permutes it: no scatter
        self.rotary_emb = RotaryEmbedding(d, d, config.rope_theta, config.rope_scaling, dtype,
                                          max_positions=config.max_position_embeddings)
        # The target holds no reference to this head; a plain reference (not a submodule) to it.
        object.__setattr__(self, "target", target)

    def make_kv_cache(self, num_blocks: int, block_size: int, device: torch.device) -> KVCache:
        # Zeros, not empty: a prefix-cache hit reads positions this head never wrote (drafts only).
        shape = (num_blocks, block_size, self.config.num_key_value_heads, self.config.head_dim)
        return (torch.zeros(shape, dtype=self.dtype, device=device), torch.zeros(shape, dtype=self.dtype, device=device))

    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        """The target's aux states [T, n_aux * target_hidden] -> the head's hidden input [T, hidden]."""
        return linear(aux.contiguous(), self.fc)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.embed_tokens is not None:
            return self.embed_tokens.index_select(0, input_ids)
        return self.target.embed(input_ids)  # type: ignore[operator]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, prev_hidden: torch.Tensor,
                meta: AttentionMetadata, kv_cache: KVCache) -> torch.Tensor:
        """Tokens [T] at positions [T] with the hidden states before them [T, hidden] -> the head's
        pre-norm output [T, hidden] (the next draft's prev_hidden; compute_logits gives its logits)."""
        layer = self.layer
        e = ops.rms_norm(self.embed(input_ids).contiguous(), layer.input_layernorm, self.eps)
        g = ops.rms_norm(prev_hidden.contiguous(), self.hidden_norm, self.eps)
        residual = g.clone() if self.norm_before_residual else prev_hidden.clone()  # the add below is in place
        cos, sin = self.rotary_emb(positions)
        attn = layer.self_attention(torch.cat([e, g], dim=-1), cos, sin, meta, kv_cache)
        x, residual = ops.fused_add_rms_norm(attn.contiguous(), residual, layer.post_attention_layernorm, self.eps)
        return layer.swiglu(x) + residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Pre-norm outputs [N, hidden] -> logits over the target's vocabulary [N, vocab] fp32: the
        draft vocabulary's at their target ids, -inf (probability 0) elsewhere."""
        logits = linear(ops.rms_norm(hidden.contiguous(), self.norm, self.eps), self.lm_head).float()
        if self.identity_vocab:
            return logits
        full = logits.new_full((logits.shape[0], self.config.vocab_size), float("-inf"))
        full.index_copy_(1, self.target_ids, logits)  # no advanced indexing: capturable in a CUDA graph
        return full

    def prepack_for_cpu(self) -> None:
        pack = cpu_linear_packer(self.fc)  # the sample must be a 2-D linear weight for PackedLinear
        if pack is None:
            return
        if get_kernel_config().cpu_q8_draft_head and self.fc.dtype == torch.float32 and hasattr(pack, "quantised_q8"):
            pack = _q8_or(pack)
        self.layer.pack(pack)
        pack_weights(self, LINEARS, pack)


def _q8_or(dense: Any) -> Callable[[torch.Tensor], Any]:
    """A packer that rounds a weight to Q8_0 (PackedLinear.quantised_q8: KernelConfig.cpu_q8_draft_head)
    where it can, else packs it dense."""
    return lambda w: dense.quantised_q8(w) or dense(w)


# The head trained for the default model (scripts/train_eagle3.py), shipped in the package.
SHIPPED_HEAD = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "heads",
                            "smollm2-135m-instruct-eagle3")


def default_head(target_path: str | None) -> str:
    """speculative_config without model: the shipped head, which fits the default target only."""
    if target_path is not None:
        raise ValueError("speculative method 'eagle3' needs speculative_config.model (the head's directory) for a "
                         "target other than the default model")
    if not os.path.isfile(os.path.join(SHIPPED_HEAD, "config.json")):
        raise ValueError(f"no EAGLE-3 head is shipped at {SHIPPED_HEAD}; train one with scripts/train_eagle3.py "
                         "and pass its directory as speculative_config.model")
    return SHIPPED_HEAD


def aux_layer_ids(cfg: dict[str, Any], target_layers: int) -> tuple[int, ...]:
    """The target layers whose input stream feeds fc: the checkpoint's, else vLLM's default."""
    ids = cfg.get("eagle_aux_hidden_state_layer_ids") or (cfg.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids")
    if ids is None:
        ids = [2, target_layers // 2, target_layers - 3]
    if (not isinstance(ids, list) or not ids
            or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i <= target_layers for i in ids)):
        raise ValueError(f"EAGLE-3 aux hidden-state layers {ids} must be a list of layer indices in 0..{target_layers} "
                         f"(the target has {target_layers} layers)")
    return tuple(ids)


def load_eagle3(path: str, target: nn.Module, target_config: ModelConfig, device: torch.device,
                dtype: torch.dtype) -> tuple[Eagle3Head, ModelConfig]:
    """The head in directory `path` for this target; ValueError naming what does not fit."""
    from pyengine.loader.hf_dir import check_safetensors_headers, read_json, safetensors_files

    if not os.path.isdir(path):
        raise ValueError(f"EAGLE-3 head {path}: not a directory (config.json + safetensors)")
    cfg = read_json(os.path.join(path, "config.json"))
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}/config.json: not a JSON object")
    if isinstance(cfg.get("transformer_layer_config"), dict):  # the speculators library's layout
        cfg = {**cfg, **cfg["transformer_layer_config"]}
    archs = cfg.get("architectures") or []
    if not any("eagle3" in str(a).lower() for a in archs):
        raise ValueError(f"{path}: architectures {archs} is not an EAGLE-3 head (e.g. LlamaForCausalLMEagle3)")
    config = ModelConfig.from_hf_dict({**cfg, "architectures": archs[:1]})
    config.validate()
    if config.num_hidden_layers != 1:
        raise ValueError(f"{path}: num_hidden_layers={config.num_hidden_layers}; an EAGLE-3 head has one layer")
    if config.vocab_size != target_config.vocab_size:
        raise ValueError(f"{path}: vocab_size {config.vocab_size} != the target's {target_config.vocab_size}")
    target_hidden = int(cfg.get("target_hidden_size") or config.hidden_size)
    if target_hidden != target_config.hidden_size:
        raise ValueError(f"{path}: target_hidden_size {target_hidden} != the target's {target_config.hidden_size}")
    draft_vocab = int(cfg.get("draft_vocab_size") or config.vocab_size)
    if not 1 <= draft_vocab <= config.vocab_size:
        raise ValueError(f"{path}: draft_vocab_size {draft_vocab} must be in 1..{config.vocab_size}")
    # Positions follow the target's (drafts run at the target's positions).
    config.max_position_embeddings = max(config.max_position_embeddings, target_config.max_position_embeddings)
    aux = aux_layer_ids(cfg, target_config.num_hidden_layers)
    head = Eagle3Head(config, target, aux, target_hidden, draft_vocab, bool(cfg.get("norm_before_residual", False)),
                      dtype)
    files = safetensors_files(path)
    check_safetensors_headers(files)
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                key = name.removeprefix("model.").replace("layers.0.", "midlayer.", 1)
                tensors[key] = f.get_tensor(name)
    _fill(head, tensors, path, draft_vocab)
    head.to(device)
    if device.type == "cpu":
        head.prepack_for_cpu()
    return head, config


def _fill(head: Eagle3Head, tensors: dict[str, torch.Tensor], path: str, draft_vocab: int) -> None:
    cfg, layer = head.config, head.layer
    hq, hkv, d, hidden = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
    vocab = cfg.vocab_size
    qkv = layer.qkv_proj.t()  # HF [out, in] views of the [in, out] parameters
    gate_up = layer.gate_up_proj.t()
    inter = cfg.intermediate_size
    targets: dict[str, torch.Tensor] = {
        "fc.weight": head.fc.t(), "norm.weight": head.norm, "lm_head.weight": head.lm_head.t(),
        "midlayer.hidden_norm.weight": head.hidden_norm,
        "midlayer.input_layernorm.weight": layer.input_layernorm,
        "midlayer.post_attention_layernorm.weight": layer.post_attention_layernorm,
        "midlayer.self_attn.q_proj.weight": qkv.narrow(0, 0, hq * d),
        "midlayer.self_attn.k_proj.weight": qkv.narrow(0, hq * d, hkv * d),
        "midlayer.self_attn.v_proj.weight": qkv.narrow(0, (hq + hkv) * d, hkv * d),
        "midlayer.self_attn.o_proj.weight": layer.o_proj.t(),
        "midlayer.mlp.gate_proj.weight": gate_up.narrow(0, 0, inter),
        "midlayer.mlp.up_proj.weight": gate_up.narrow(0, inter, inter),
        "midlayer.mlp.down_proj.weight": layer.down_proj.t()}
    if layer.qkv_bias is not None:  # config attention_bias
        targets.update({"midlayer.self_attn.q_proj.bias": layer.qkv_bias.narrow(0, 0, hq * d),
                        "midlayer.self_attn.k_proj.bias": layer.qkv_bias.narrow(0, hq * d, hkv * d),
                        "midlayer.self_attn.v_proj.bias": layer.qkv_bias.narrow(0, (hq + hkv) * d, hkv * d)})
    optional = {"embed_tokens.weight": (vocab, hidden), "d2t": (draft_vocab,), "t2d": (vocab,)}
    for name in tensors:
        if name not in targets and name not in optional:
            raise ValueError(f"{path}: unexpected tensor {name} in an EAGLE-3 head")
    for name, dst in targets.items():
        src = tensors.get(name)
        if src is None:
            raise ValueError(f"{path}: EAGLE-3 head lacks tensor {name}")
        if tuple(src.shape) != tuple(dst.shape):
            raise ValueError(f"{path}: tensor {name} has shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
        with torch.no_grad():
            dst.copy_(src.to(head.dtype))
    for name, shape in optional.items():
        if name in tensors and tuple(tensors[name].shape) != shape:
            raise ValueError(f"{path}: tensor {name} has shape {tuple(tensors[name].shape)}, expected {shape}")
    if "embed_tokens.weight" in tensors:
        head.embed_tokens = tensors["embed_tokens.weight"].to(head.dtype).contiguous()
    elif hidden != head.target.config.hidden_size:  # type: ignore[union-attr]
        raise ValueError(f"{path}: hidden_size {hidden} differs from the target's and there is no embed_tokens.weight")
    ids = torch.arange(draft_vocab)
    if "d2t" in tensors:
        d2t = tensors["d2t"]
        if d2t.is_floating_point() or d2t.dtype == torch.bool:
            raise ValueError(f"{path}: d2t must hold integer offsets, got {d2t.dtype}")
        ids = ids + d2t.long()
        if int(ids.min()) < 0 or int(ids.max()) >= vocab or ids.unique().numel() != draft_vocab:
            raise ValueError(f"{path}: d2t maps draft ids outside 0..{vocab - 1} or two onto one target id")
    elif draft_vocab != vocab:
        raise ValueError(f"{path}: draft_vocab_size {draft_vocab} < vocab_size {vocab} needs the tensor d2t")
    head.target_ids = ids
    head.identity_vocab = draft_vocab == vocab and bool((ids == torch.arange(vocab)).all())
