"""Qwen3-Next (`Qwen3NextForCausalLM`): Gated DeltaNet layers and gated full-attention layers
(placed by `layer_types`), MoE with a gated shared expert, zero-centred RMSNorms (scale 1 + w).

Gated DeltaNet (linear_attention) layer, per token: in_proj_qkvz -> q, k (H key heads), v, z (HV
value heads); a causal depthwise conv (SiLU) over q|k|v; beta = sigmoid(b), g = -exp(A_log) *
softplus(a + dt_bias); the gated delta rule over the recurrent state (fp32, stored [HV, V, K]; pyengine/ops/
reference/gdn.py is the spec); a gated RMSNorm per value head (norm(o) * silu(z)); out_proj.
Conv and recurrent state live in the runner's StateCache: the conv windows with the Mamba2
conventions (each row reads conv offset a - 1); the recurrent state as a base state (after the step's
first token, slot idx[n, 0]) and a record per later token (slot idx[n, t]), replayed for the a - 1
accepted ones by the next step (pyengine/ops/reference/gdn.py), so a row with no drafts after an
accepted run takes the same path as a verify row.

Full-attention layer: q_proj yields the query and an output gate per head (sigmoid); per-head
q/k RMSNorm; RoPE on the first partial_rotary_factor of each head; the paged GQA kernels.

Checkpoint layouts are rearranged once at load: the per-key-head groups of in_proj_qkvz / in_proj_ba
become [q | k | v | z] and [b | a]; q/k rows (and their norms) are permuted into the RoPE layout
(as Bamba's); each zero-centred norm stores 1 + w.

Batch invariance on CUDA (docs/architecture.md): [in, out] projections on the invariant GEMMs
(prepack_for_cuda checks widths), experts on the grouped one; every norm a row kernel (head_rms_norm);
conv and delta rule per-row kernels whose prefill computes decode's bits (no chunk-wise GDN prefill);
attention the GQA kernel without key splits (other dtypes / head sizes: the per-query reference).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pyengine import ops
from pyengine.config import ModelConfig, hf_int
from pyengine.engine.attention_metadata import AttentionMetadata
from pyengine.engine.state_cache import DeltaRuleShapes, StateCache, StateMetadata
from pyengine.models.bamba import rope_permutation
from pyengine.models.layers import (KVCache, RotaryEmbedding, WeightTargets, cpu_linear_packer, linear, onednn_prepack,
                                    pack_weights, param, rms_norm_rows, rowwise, unit_weight)
from pyengine.models.moe import MoE, MoEConfig, SwiGLU, moe_graphable
from pyengine.models.weight_utils import decoder_weight_targets, load_named_weights


@dataclass
class Qwen3NextModelConfig(ModelConfig):
    layer_types: list[str] = field(default_factory=list)
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    rotary_dim: int = 64
    moe: MoEConfig | None = None
    moe_layers: list[bool] = field(default_factory=list)
    num_nextn_predict_layers: int = 0
    load_mtp: bool = False
    split_projections: bool = False  # Qwen3.5: in_proj_qkv / _z / _b / _a instead of in_proj_qkvz / _ba
    checkpoint_prefix: str = "model."  # Qwen3.5 ...ForConditionalGeneration: "model.language_model."

    def kv_elements_per_token(self) -> int:
        full = sum(t == "full_attention" for t in self.layer_types) + int(self.load_mtp)
        return full * 2 * self.num_key_value_heads * self.head_dim

    def validate(self) -> None:
        super().validate()
        if len(self.layer_types) != self.num_hidden_layers or set(self.layer_types) - {"linear_attention", "full_attention"}:
            raise ValueError(f"layer_types must name linear_attention or full_attention for each of the "
                             f"{self.num_hidden_layers} layers, got {self.layer_types}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(f"linear_num_value_heads ({self.linear_num_value_heads}) must be a multiple of "
                             f"linear_num_key_heads ({self.linear_num_key_heads})")
        if self.moe is not None:
            self.moe.validate()


def qwen3_next_model_config(cfg: dict[str, Any]) -> Qwen3NextModelConfig:
    base = ModelConfig.from_hf_dict(cfg)
    n = base.num_hidden_layers
    types = cfg.get("layer_types") or ["full_attention" if (i + 1) % int(cfg.get("full_attention_interval", 4)) == 0
                                       else "linear_attention" for i in range(n)]
    rope = cfg.get("rope_parameters") or {}
    partial = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25)))
    experts = int(cfg.get("num_experts") or 0)
    moe = None
    if experts:
        moe = MoEConfig(num_experts=experts, top_k=hf_int(cfg, "num_experts_per_tok"), n_group=1, topk_group=1,
                        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)), routed_scaling_factor=1.0,
                        n_shared_experts=1, moe_intermediate_size=hf_int(cfg, "moe_intermediate_size"),
                        scoring_func="softmax", correction_bias=False,
                        shared_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0),
                        shared_expert_gate=True, hf_shared_name="shared_expert")
    mlp_only = set(cfg.get("mlp_only_layers") or [])
    step = int(cfg.get("decoder_sparse_step") or 1)
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(ModelConfig)}
    return Qwen3NextModelConfig(
        **fields, layer_types=list(types), linear_num_key_heads=hf_int(cfg, "linear_num_key_heads"),
        linear_num_value_heads=hf_int(cfg, "linear_num_value_heads"),
        linear_key_head_dim=hf_int(cfg, "linear_key_head_dim"), linear_value_head_dim=hf_int(cfg, "linear_value_head_dim"),
        linear_conv_kernel_dim=hf_int(cfg, "linear_conv_kernel_dim", 4), rotary_dim=int(base.head_dim * partial),
        moe=moe, moe_layers=[moe is not None and i not in mlp_only and (i + 1) % step == 0 for i in range(n)],
        num_nextn_predict_layers=int(cfg.get("num_nextn_predict_layers") or 0))


def qwen3_5_model_config(cfg: dict[str, Any]) -> Qwen3NextModelConfig:
    """Qwen3.5 (Qwen3_5[Moe]ForCausalLM, or the text part of Qwen3_5[Moe]ForConditionalGeneration,
    whose vision tower is not loaded): Qwen3-Next's layers with the delta-rule projections stored
    apart; a multimodal checkpoint nests the text config and prefixes its tensors."""
    nested = "text_config" in cfg
    text = dict(cfg["text_config"]) if nested else dict(cfg)
    text["architectures"] = cfg.get("architectures")
    for key in ("tie_word_embeddings", "eos_token_id", "bos_token_id"):
        if key in cfg and text.get(key) is None:
            text[key] = cfg[key]
    config = qwen3_next_model_config(text)
    config.split_projections = True
    config.checkpoint_prefix = "model.language_model." if nested else "model."
    return config


def zero_centred(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """Qwen3-Next RMSNorms scale by 1 + w (the gated norm of the delta rule by w itself)."""
    norm = name.endswith(("norm.weight", "norm_embedding.weight", "norm_hidden.weight"))
    return tensor + 1 if norm and "linear_attn.norm" not in name else tensor


def head_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm of each head of an fp32 x [T, heads, D], then times weight [D] fp32 (None: 1). On CUDA
    pyengine's row kernel over a fresh [T * heads, D] copy (layers.rms_norm_rows: torch's reductions
    lay their threads out by the number of rows; a fresh tensor's alignment, which picks the kernel's
    vector width, never depends on the batch); on the CPU torch's, whose rows are independent."""
    if x.is_cuda:
        d = x.shape[-1]
        w = unit_weight(d, x.device) if weight is None else weight
        return rms_norm_rows(x.reshape(-1, d).contiguous(), w, eps).view(x.shape)
    y = F.rms_norm(x, (x.shape[-1],), None, eps)
    return y if weight is None else y * weight


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: Qwen3NextModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.h, self.hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv, self.width = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim
        self.key_dim, self.value_dim = self.h * self.dk, self.hv * self.dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.eps, self.split = cfg.rms_norm_eps, cfg.split_projections
        self.in_proj_qkvz: Any = param(cfg.hidden_size, self.conv_dim + self.value_dim, dtype=dtype)  # [q|k|v|z]
        self.in_proj_ba: Any = param(cfg.hidden_size, 2 * self.hv, dtype=dtype)  # [b|a]
        self.conv_weight = param(self.conv_dim, self.width, dtype=dtype)
        self.dt_bias = param(self.hv, dtype=dtype)
        self.A_log = param(self.hv, dtype=dtype)
        self.norm = param(self.dv, dtype=dtype)
        self.out_proj: Any = param(self.value_dim, cfg.hidden_size, dtype=dtype)

    def state_shape(self, k: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        # recurrent state S^T per head; the slots after a row's first hold token records
        return DeltaRuleShapes(((self.width - 1 + k, self.conv_dim), (self.hv, self.dv, self.dk)))

    def weight_targets(self, prefix: str) -> WeightTargets:
        qkvz, ba = self.in_proj_qkvz.t(), self.in_proj_ba.t()
        if self.split:  # Qwen3.5: stored apart, q|k|v already in order
            proj: WeightTargets = {
                prefix + "in_proj_qkv.weight": (self.in_proj_qkvz, qkvz.narrow(0, 0, self.conv_dim)),
                prefix + "in_proj_z.weight": (self.in_proj_qkvz, qkvz.narrow(0, self.conv_dim, self.value_dim)),
                prefix + "in_proj_b.weight": (self.in_proj_ba, ba.narrow(0, 0, self.hv)),
                prefix + "in_proj_a.weight": (self.in_proj_ba, ba.narrow(0, self.hv, self.hv))}
        else:
            proj = {prefix + "in_proj_qkvz.weight": (self.in_proj_qkvz, qkvz),
                    prefix + "in_proj_ba.weight": (self.in_proj_ba, ba)}
        return {**proj,
                prefix + "conv1d.weight": (self.conv_weight, self.conv_weight),
                prefix + "dt_bias": (self.dt_bias, self.dt_bias), prefix + "A_log": (self.A_log, self.A_log),
                prefix + "norm.weight": (self.norm, self.norm),
                prefix + "out_proj.weight": (self.out_proj, self.out_proj.t())}

    def regroup(self, name: str, w: torch.Tensor) -> torch.Tensor:
        """HF's per-key-head groups [q_g | k_g | v_g | z_g] (and [b_g | a_g]) -> [q | k | v | z] ([b | a])."""
        per = self.hv // self.h
        if name.endswith("in_proj_qkvz.weight"):
            g = w.view(self.h, 2 * self.dk + 2 * per * self.dv, -1)
            q, k, v, z = g.split([self.dk, self.dk, per * self.dv, per * self.dv], dim=1)
            return torch.cat([t.reshape(-1, w.shape[-1]) for t in (q, k, v, z)])
        if name.endswith("in_proj_ba.weight"):
            b, a = w.view(self.h, 2 * per, -1).split([per, per], dim=1)
            return torch.cat([b.reshape(-1, w.shape[-1]), a.reshape(-1, w.shape[-1])])
        return w

    def forward(self, x: torch.Tensor, state: StateMetadata, conv_state: torch.Tensor,
                rec_state: torch.Tensor) -> torch.Tensor:
        t, nd = x.shape[0], state.num_decode_tokens
        qkvz = linear(x, self.in_proj_qkvz)
        mixed, z = qkvz[:, :self.conv_dim].contiguous(), qkvz[:, self.conv_dim:]
        b, a = linear(x, self.in_proj_ba).float().split([self.hv, self.hv], dim=-1)
        dec_qsl, dec_idx, dec_acc = state.decode_rows()
        pre_qsl, pre_idx, pre_acc, pre_init = state.prefill_rows()
        conv = torch.empty_like(mixed)
        if state.num_decode_rows:
            conv[:nd] = ops.causal_conv1d_update(mixed[:nd], conv_state, self.conv_weight, None, dec_qsl, dec_idx,
                                                 dec_acc, "silu")
        if nd < t:
            conv[nd:] = ops.causal_conv1d_fn(mixed[nd:], conv_state, self.conv_weight, None, pre_qsl, pre_idx, pre_acc,
                                             pre_init, "silu")
        q, k, v = conv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q, k, v = q.reshape(t, self.h, self.dk), k.reshape(t, self.h, self.dk), v.reshape(t, self.hv, self.dv)
        beta = rowwise(torch.sigmoid, b.contiguous())
        g = -self.A_log.float().exp() * rowwise(F.softplus, (a + self.dt_bias.float()).contiguous())
        o = torch.empty_like(v)
        if state.num_decode_rows:
            o[:nd] = ops.gated_delta_rule_update(q[:nd], k[:nd], v[:nd], g[:nd], beta[:nd], rec_state, dec_qsl,
                                                 dec_idx, dec_acc)
        if nd < t:
            # CUDA: the chunk-wise kernel by default; under KernelConfig.batch_invariant the recurrence,
            # so that a token gets the same bits prefilled (cut anywhere), re-prefilled after
            # preemption, or decoded (ops.gated_delta_rule_prefill)
            o[nd:] = ops.gated_delta_rule_prefill(q[nd:], k[nd:], v[nd:], g[nd:], beta[nd:], pre_qsl, rec_state,
                                                  pre_idx, pre_acc, pre_init)
        # gated RMSNorm per value head: norm(o) * w, then times silu(z), in fp32
        of = head_rms_norm(o.float(), None, self.eps)
        gated = (self.norm * of.to(x.dtype)).float().reshape(t, -1) * rowwise(F.silu, z.float().contiguous())
        return linear(gated.to(x.dtype), self.out_proj)


class GatedAttention(nn.Module):
    """One projection [q | gate | k | v]; RMSNorm per q/k head; partial RoPE; paged GQA attention;
    the output times sigmoid(gate); o_proj."""

    def __init__(self, cfg: Qwen3NextModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.hq, self.hkv, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.eps, self.scale = cfg.rms_norm_eps, cfg.head_dim ** -0.5
        self.qgkv_proj: Any = param(cfg.hidden_size, (2 * self.hq + 2 * self.hkv) * self.d, dtype=dtype)
        self.q_norm = param(self.d, dtype=dtype)
        self.k_norm = param(self.d, dtype=dtype)
        self.o_proj: Any = param(self.hq * self.d, cfg.hidden_size, dtype=dtype)
        self.register_buffer("perm", rope_permutation(cfg.head_dim, cfg.rotary_dim), persistent=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                kv_cache: KVCache) -> torch.Tensor:
        t, hq, hkv, d = x.shape[0], self.hq, self.hkv, self.d
        y = linear(x, self.qgkv_proj)
        q, gate = y[:, :hq * d].view(t, hq, d), y[:, hq * d:2 * hq * d]
        k, v = y[:, 2 * hq * d:(2 * hq + hkv) * d].view(t, hkv, d), y[:, (2 * hq + hkv) * d:].view(t, hkv, d)
        qn = head_rms_norm(q.float(), self.q_norm.float(), self.eps)
        kn = head_rms_norm(k.float(), self.k_norm.float(), self.eps)
        qk = torch.cat([qn, kn], dim=1).to(x.dtype)
        ops.rope_and_cache(qk, v, cos, sin, kv_cache[0], kv_cache[1], meta.slot_mapping)
        out = ops.paged_attention(qk[:, :hq], kv_cache[0], kv_cache[1], meta, self.scale)
        assert isinstance(out, torch.Tensor)
        gated = out.reshape(t, hq * d).float() * rowwise(torch.sigmoid, gate.float().contiguous())
        return linear(gated.to(x.dtype), self.o_proj)

    def weight_targets(self, prefix: str) -> WeightTargets:
        hq, hkv, d = self.hq, self.hkv, self.d
        w = self.qgkv_proj.t()
        return {prefix + "q_proj.weight": (self.qgkv_proj, w.narrow(0, 0, 2 * hq * d)),
                prefix + "k_proj.weight": (self.qgkv_proj, w.narrow(0, 2 * hq * d, hkv * d)),
                prefix + "v_proj.weight": (self.qgkv_proj, w.narrow(0, (2 * hq + hkv) * d, hkv * d)),
                prefix + "q_norm.weight": (self.q_norm, self.q_norm), prefix + "k_norm.weight": (self.k_norm, self.k_norm),
                prefix + "o_proj.weight": (self.o_proj, self.o_proj.t())}

    def rearrange(self, name: str, w: torch.Tensor) -> torch.Tensor:
        """HF q_proj's per-head [query | gate] rows -> [q | gate]; q/k rows and norms in RoPE order."""
        d, hid = self.d, w.shape[-1]
        if name.endswith("q_proj.weight"):
            per_head = w.view(self.hq, 2, d, hid)
            return torch.cat([per_head[:, 0][:, self.perm].reshape(-1, hid), per_head[:, 1].reshape(-1, hid)])
        if name.endswith("k_proj.weight"):
            return w.view(self.hkv, d, hid)[:, self.perm].reshape(-1, hid)
        if name.endswith(("q_norm.weight", "k_norm.weight")):
            return w[self.perm]
        return w


class Qwen3NextDecoderLayer(nn.Module):
    def __init__(self, cfg: Qwen3NextModelConfig, i: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = cfg.rms_norm_eps
        self.is_attention = cfg.layer_types[i] == "full_attention"
        self.mixer: nn.Module = GatedAttention(cfg, dtype) if self.is_attention else GatedDeltaNet(cfg, dtype)
        self.input_layernorm = param(cfg.hidden_size, dtype=dtype)
        self.post_attention_layernorm = param(cfg.hidden_size, dtype=dtype)
        self.mlp: nn.Module = (MoE(cfg.hidden_size, cfg.moe, dtype) if cfg.moe is not None and cfg.moe_layers[i]
                               else SwiGLU(cfg.hidden_size, cfg.intermediate_size, dtype))

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata, kv_cache: KVCache | None, state: StateMetadata | None,
                layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """vLLM's residual stream (see LlamaDecoderLayer): returns (MLP output, residual)."""
        if residual is None:
            residual, x = h, ops.rms_norm(h, self.input_layernorm, self.eps)
        else:
            x, residual = ops.fused_add_rms_norm(h, residual, self.input_layernorm, self.eps)
        if self.is_attention:
            assert kv_cache is not None
            mixed = self.mixer(x, cos, sin, meta, kv_cache)
        else:
            assert state is not None
            mixed = self.mixer(x, state, state.conv[layer], state.ssm[layer])
        x, residual = ops.fused_add_rms_norm(mixed, residual, self.post_attention_layernorm, self.eps)
        return self.mlp(x), residual

    def weight_targets(self, prefix: str) -> WeightTargets:
        t = self.mixer.weight_targets(prefix + ("self_attn." if self.is_attention else "linear_attn."))  # type: ignore[operator]
        t.update(self.mlp.weight_targets(prefix + "mlp."))  # type: ignore[operator]
        for norm in ("input_layernorm", "post_attention_layernorm"):
            t[f"{prefix}{norm}.weight"] = (getattr(self, norm), getattr(self, norm))
        return t


def invariant_gemm_misfits(model: nn.Module, tied_head: torch.Tensor | None) -> list[str]:
    """'name (shape)' of each projection (experts, a tied lm_head [in, out]) the invariant GEMMs do not
    take: fp32 any; fp16/bf16 contiguous with N % 8 and K % 64 (AMD's skinny GEMM: K % 8). The shared
    expert gate's one column is padded at the call (MoE._shared_gate_logit)."""
    k_step = 64 if torch.version.hip is None else 8
    weights = [(n, p) for n, p in model.named_parameters() if p.dim() >= 2 and not n.endswith(("embed_tokens",
                                                                                              "conv_weight"))]
    weights += [] if tied_head is None else [("lm_head (tied)", tied_head)]
    return [f"{name} {tuple(w.shape)}" for name, w in weights if w.dtype != torch.float32 and (
        not w.is_contiguous() or w.shape[-2] % k_step or (w.shape[-1] % 8 and not name.endswith("shared_expert_gate")))]


class Qwen3NextForCausalLM(nn.Module):
    @property
    def supports_cuda_graphs(self) -> bool:
        return moe_graphable(self.layers, self.dtype)

    def __init__(self, config: Qwen3NextModelConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config, self.dtype = config, dtype
        self.embed_tokens = param(config.vocab_size, config.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(Qwen3NextDecoderLayer(config, i, dtype) for i in range(config.num_hidden_layers))
        self.norm = param(config.hidden_size, dtype=dtype)
        self.lm_head: Any = None if config.tie_word_embeddings else param(config.hidden_size, config.vocab_size,
                                                                          dtype=dtype)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rotary_dim, config.rope_theta, config.rope_scaling,
                                          dtype, max_positions=config.max_position_embeddings)
        self.packed_lm_head: Any = None  # set by prepack_for_cpu
        self.owns_cpu_threads = False
        self.mtp: nn.Module | None = None
        if config.load_mtp:
            from pyengine.models.qwen3_next_mtp import Qwen3NextMtp

            self.mtp = Qwen3NextMtp(self, dtype)

    def prepack_for_cpu(self) -> bool:
        """Every linear on the CPU's packed GEMM, as DeepseekV3ForCausalLM.prepack_for_cpu."""
        if self.embed_tokens.device.type != "cpu":
            return False
        pack = cpu_linear_packer(self.embed_tokens)
        if pack is None:
            return False
        pack_router = cpu_linear_packer(torch.zeros(2, 2))
        layers = list(self.layers) + ([] if self.mtp is None else [self.mtp.layer])  # type: ignore[union-attr]
        for layer in layers:
            pack_weights(layer.mixer, ("in_proj_qkvz", "in_proj_ba", "out_proj", "qgkv_proj", "o_proj"), pack)
            if isinstance(layer.mlp, MoE):
                layer.mlp.pack(pack, pack_router)
            else:
                layer.mlp.pack(pack)  # type: ignore[operator]
        if self.mtp is not None:
            pack_weights(self.mtp, ("fc",), pack)
        if self.lm_head is None:  # tied: the table stays dense for the lookup, its transpose is packed
            self.packed_lm_head = pack(self.embed_tokens.detach().t())
        else:
            pack_weights(self, ("lm_head",), pack)
            self.packed_lm_head = self.lm_head
        self.owns_cpu_threads = pack is not onednn_prepack
        return True

    def prepack_for_cuda(self) -> bool:
        """Under KernelConfig.batch_invariant on CUDA (LLM calls it): the [in, out] projections already
        run the invariant GEMMs; a tied lm_head gets a contiguous copy. Raises ValueError (at load, not
        the first step) for widths they do not take. False (unchanged) off CUDA or when done already."""
        if self.embed_tokens.device.type != "cuda" or self.packed_lm_head is not None:
            return False
        head = self.embed_tokens.detach().t() if self.lm_head is None else self.lm_head
        misfits = invariant_gemm_misfits(self, head if self.lm_head is None else None)
        if misfits:
            more = f" and {len(misfits) - 6} more" if len(misfits) > 6 else ""
            raise ValueError(f"{type(self).__name__}: batch_invariant on CUDA needs every projection on pyengine's "
                             f"invariant GEMM, which does not take these {self.dtype} [in, out] weights (K must be "
                             f"a multiple of 64, N of 8): {', '.join(misfits[:6])}{more}")
        self.packed_lm_head = head.contiguous()
        return True

    def state_shapes(self, num_spec_tokens: int) -> list[tuple[tuple[int, ...], tuple[int, ...]] | None]:
        return [None if layer.is_attention else layer.mixer.state_shape(num_spec_tokens) for layer in self.layers]

    def make_kv_caches(self, num_blocks: int, block_size: int, device: torch.device) -> list[KVCache | None]:
        """A (K, V) pair for each full-attention layer; the delta-rule layers keep recurrent state."""
        shape = (num_blocks, block_size, self.config.num_key_value_heads, self.config.head_dim)
        return [(torch.empty(shape, dtype=self.dtype, device=device), torch.empty(shape, dtype=self.dtype, device=device))
                if layer.is_attention else None for layer in self.layers]

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, kv_caches: list,
                state: StateMetadata | None = None) -> torch.Tensor:
        if state is None:  # a standalone forward: every row a prefill from zero state
            state = StateCache.scratch(self, meta.query_start_loc, self.dtype, input_ids.device)
        cos, sin = self.rotary_emb(positions)
        h, residual = F.embedding(input_ids, self.embed_tokens), None
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            h, residual = layer(h, residual, cos, sin, meta, kv_cache, state, i)
        assert residual is not None
        return ops.fused_add_rms_norm(h, residual, self.norm, self.config.rms_norm_eps)[0]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.packed_lm_head is not None:
            return linear(hidden, self.packed_lm_head).float()
        return linear(hidden, self.embed_tokens.t() if self.lm_head is None else self.lm_head).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """HF names, rearranged (module docstring); mtp.* tensors only with load_mtp."""
        owners = {}
        for i, layer in enumerate(self.layers):
            owners[f"model.layers.{i}."] = layer.mixer
        if self.mtp is not None:
            owners.update(self.mtp.rearrangers())  # type: ignore[operator]

        def transform(name: str, w: torch.Tensor) -> torch.Tensor:
            w = zero_centred(name, w)
            for prefix, mixer in owners.items():
                if name.startswith(prefix):
                    return mixer.regroup(name, w) if isinstance(mixer, GatedDeltaNet) else mixer.rearrange(name, w)
            return w

        prefix = self.config.checkpoint_prefix

        def wanted(items: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
            for name, w in items:
                if name.startswith("model.visual.") or (self.mtp is None and name.startswith("mtp.")):
                    continue  # a multimodal checkpoint's vision tower; MTP layers unless speculating with them
                yield ("model." + name[len(prefix):] if name.startswith(prefix) else name), w

        load_named_weights(self, decoder_weight_targets(self), wanted(weights), self.lm_head is None, transform)
