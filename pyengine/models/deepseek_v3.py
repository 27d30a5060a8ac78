"""DeepSeek-V3 / Kimi-K2 (`DeepseekV3ForCausalLM`): MLA attention over a latent paged cache, and
MoE layers after the first `first_k_dense_replace` dense ones.

MLA (pyengine/ops/reference/mla.py is the attention's spec): a token's cache row is
[kv_a_layernorm(c_kv) | rope(k_pe)] (R = kv_lora_rank, P = qk_rope_head_dim). Every row - prefill,
decode and verify alike - runs the absorbed form: q_nope of head h times W_UK[h] gives the latent
query, attention reads the latent rows, and W_UV[h] maps the latent output to the head's values.
One form for every query keeps a token's bits independent of whether it was prefilled or decoded.
The multi-token-prediction layers stored after the decoder layers are models/deepseek_mtp.py's.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from pyengine import ops
from pyengine.config import ModelConfig, hf_int
from pyengine.engine.attention_metadata import AttentionMetadata
from pyengine.models.layers import (WeightTargets, cpu_linear_packer, linear, onednn_prepack, pack_weights, param,
                                    rope_attention_factor, rope_inv_freq, yarn_mscale)
from pyengine.models.moe import MoE, MoEConfig, SwiGLU, moe_graphable
from pyengine.models.weight_utils import decoder_weight_targets, load_named_weights
from pyengine.ops.kernel_config import get_kernel_config


@dataclass
class DeepseekV3ModelConfig(ModelConfig):
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    rope_interleave: bool = True
    first_k_dense_replace: int = 0
    moe: MoEConfig | None = None
    num_nextn_predict_layers: int = 0
    load_mtp: bool = False  # also build and load the MTP layers (set when speculating with method "mtp")

    def kv_elements_per_token(self) -> int:
        """One latent row per layer, and one for the MTP layer's cache when it is loaded."""
        return (self.num_hidden_layers + int(self.load_mtp)) * (self.kv_lora_rank + self.qk_rope_head_dim)

    def validate(self) -> None:
        super().validate()
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")
        if self.moe is not None:
            self.moe.validate()


def deepseek_v3_model_config(cfg: dict[str, Any]) -> DeepseekV3ModelConfig:
    base = ModelConfig.from_hf_dict(cfg)
    quant = cfg.get("quantization_config")
    if quant is not None and (not isinstance(quant, dict) or quant.get("quant_method") != "fp8"
                              or list(quant.get("weight_block_size") or [128, 128]) != [128, 128]):
        raise ValueError(f"unsupported quantization_config {quant!r} (supported: fp8 with 128x128 weight blocks)")
    q_lora = cfg.get("q_lora_rank")
    experts = int(cfg.get("n_routed_experts") or 0)
    moe = None
    if experts:
        moe = MoEConfig(num_experts=experts, top_k=hf_int(cfg, "num_experts_per_tok"),
                        n_group=int(cfg.get("n_group") or 1), topk_group=int(cfg.get("topk_group") or 1),
                        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
                        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
                        n_shared_experts=int(cfg.get("n_shared_experts") or 0),
                        moe_intermediate_size=hf_int(cfg, "moe_intermediate_size"),
                        scoring_func=str(cfg.get("scoring_func", "sigmoid")))
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(ModelConfig)}
    fields["head_dim"] = hf_int(cfg, "qk_nope_head_dim", 128) + hf_int(cfg, "qk_rope_head_dim", 64)
    fields["num_key_value_heads"] = 1  # one latent row per token
    return DeepseekV3ModelConfig(
        **fields, q_lora_rank=None if q_lora is None else int(q_lora), kv_lora_rank=hf_int(cfg, "kv_lora_rank"),
        qk_nope_head_dim=hf_int(cfg, "qk_nope_head_dim", 128), qk_rope_head_dim=hf_int(cfg, "qk_rope_head_dim", 64),
        v_head_dim=hf_int(cfg, "v_head_dim", 128), rope_interleave=bool(cfg.get("rope_interleave", True)),
        first_k_dense_replace=int(cfg.get("first_k_dense_replace") or 0) if moe else hf_int(cfg, "num_hidden_layers"),
        moe=moe, num_nextn_predict_layers=int(cfg.get("num_nextn_predict_layers") or 0))


class MlaRope(nn.Module):
    """RoPE of the decoupled rope dims (shared k_pe and each head's q_pe), YaRN-scaled where the
    config says. rope_interleave: dims are (x0, x1), (x2, x3), ... pairs (DeepSeek's layout), read
    as even | odd halves; the output is the halves' layout either way, for q and k alike."""

    def __init__(self, cfg: DeepseekV3ModelConfig) -> None:
        super().__init__()
        self.interleave = cfg.rope_interleave
        inv_freq = rope_inv_freq(cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling)
        angles = torch.arange(cfg.max_position_embeddings, dtype=torch.float64)[:, None] * inv_freq
        factor = rope_attention_factor(cfg.rope_scaling)
        self.register_buffer("cos", (angles.cos() * factor).float(), persistent=False)
        self.register_buffer("sin", (angles.sin() * factor).float(), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [T, ..., P] -> rotated, fp32 math, x's dtype."""
        shape = (positions.shape[0],) + (1,) * (x.dim() - 2) + (-1,)
        cos, sin = self.cos[positions].view(shape), self.sin[positions].view(shape)
        xf = x.float()
        if self.interleave:
            x1, x2 = xf[..., 0::2], xf[..., 1::2]
        else:
            x1, x2 = xf.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def per_head_linear(x: torch.Tensor, weights: Any) -> torch.Tensor:
    """x [T, H, in] times head h's [in, out] weight -> [T, H, out]. weights: a stacked [H, in, out]
    tensor (one batched GEMM: under KernelConfig.batch_invariant the grouped invariant GEMM, heads
    as groups, else torch.bmm) or a list of packed per-head weights (the CPU's batch-invariant GEMM)."""
    if isinstance(weights, torch.Tensor):
        if get_kernel_config().batch_invariant:
            return ops.grouped_linear(x, weights)
        return torch.bmm(x.transpose(0, 1), weights).transpose(0, 1)
    return torch.stack([linear(x[:, h], w) for h, w in enumerate(weights)], dim=1)


class MlaAttention(nn.Module):
    def __init__(self, cfg: DeepseekV3ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        h, hidden = cfg.num_attention_heads, cfg.hidden_size
        self.num_heads, self.eps = h, cfg.rms_norm_eps
        self.nope, self.rope_dim, self.v_dim, self.rank = (cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
                                                           cfg.kv_lora_rank)
        qk = self.nope + self.rope_dim
        self.q_lora = cfg.q_lora_rank
        if self.q_lora is None:
            self.q_proj: Any = param(hidden, h * qk, dtype=dtype)
        else:
            self.q_a_proj: Any = param(hidden, self.q_lora, dtype=dtype)
            self.q_a_layernorm = param(self.q_lora, dtype=dtype)
            self.q_b_proj: Any = param(self.q_lora, h * qk, dtype=dtype)
        self.kv_a_proj: Any = param(hidden, self.rank + self.rope_dim, dtype=dtype)
        self.kv_a_layernorm = param(self.rank, dtype=dtype)
        # kv_b_proj split per head: W_UK [h, nope, R] absorbs into the query, W_UV [h, R, v] follows attention.
        self.w_uk: Any = param(h, self.nope, self.rank, dtype=dtype)
        # A buffer, not a parameter: load_kv_b fills it from the same kv_b_proj tensor as w_uk.
        self.w_uv: Any
        self.register_buffer("w_uv", torch.empty(h, self.rank, self.v_dim, dtype=dtype), persistent=False)
        self.o_proj: Any = param(h * self.v_dim, hidden, dtype=dtype)
        self.scale = qk ** -0.5
        scaling = cfg.rope_scaling
        if scaling is not None and scaling["rope_type"] == "yarn" and scaling.get("mscale_all_dim"):
            self.scale *= yarn_mscale(float(scaling["factor"]), float(scaling["mscale_all_dim"])) ** 2

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: MlaRope, meta: AttentionMetadata,
                kv_cache: torch.Tensor) -> torch.Tensor:
        t, h = x.shape[0], self.num_heads
        if self.q_lora is None:
            q = linear(x, self.q_proj)
        else:
            q = linear(ops.rms_norm(linear(x, self.q_a_proj), self.q_a_layernorm, self.eps), self.q_b_proj)
        q = q.view(t, h, self.nope + self.rope_dim)
        kv = linear(x, self.kv_a_proj)
        c_kv = ops.rms_norm(kv[:, :self.rank].contiguous(), self.kv_a_layernorm, self.eps)
        k_pe = rope(kv[:, self.rank:], positions)
        ops.reshape_and_cache_mla(c_kv, k_pe, kv_cache, meta.slot_mapping)
        q_latent = per_head_linear(q[:, :, :self.nope], self.w_uk)
        q_full = torch.cat([q_latent, rope(q[:, :, self.nope:], positions)], dim=-1)
        out = ops.paged_attention_mla(q_full, kv_cache, meta, self.scale, kv_lora_rank=self.rank)
        assert isinstance(out, torch.Tensor)
        return linear(per_head_linear(out, self.w_uv).reshape(t, h * self.v_dim), self.o_proj)

    def weight_targets(self, prefix: str) -> WeightTargets:
        targets: WeightTargets = {}
        for hf, ours in (("q_proj", "q_proj"), ("q_a_proj", "q_a_proj"), ("q_b_proj", "q_b_proj"),
                         ("kv_a_proj_with_mqa", "kv_a_proj"), ("o_proj", "o_proj")):
            if hasattr(self, ours):
                targets[f"{prefix}{hf}.weight"] = (getattr(self, ours), getattr(self, ours).t())
        for norm in ("q_a_layernorm", "kv_a_layernorm"):
            if hasattr(self, norm):
                targets[f"{prefix}{norm}.weight"] = (getattr(self, norm), getattr(self, norm))
        # HF kv_b_proj [h * (nope + v), R]: per head nope rows of W_UK then v rows of W_UV.
        targets[prefix + "kv_b_proj.weight"] = (self.w_uk, self.w_uk)  # filled by the transform below
        return targets

    def load_kv_b(self, kv_b: torch.Tensor) -> torch.Tensor:
        """HF kv_b_proj [h * (nope + v), R] -> w_uk's [h, nope, R] (w_uv filled here too)."""
        per_head = kv_b.view(self.num_heads, self.nope + self.v_dim, self.rank)
        with torch.no_grad():
            self.w_uv.copy_(per_head[:, self.nope:].transpose(1, 2))
        return per_head[:, :self.nope]

    def pack(self, pack: Callable[[torch.Tensor], Any]) -> None:
        pack_weights(self, ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj", "o_proj"), pack)
        for name in ("w_uk", "w_uv"):
            packed_heads = [pack(w) for w in getattr(self, name).detach()]
            delattr(self, name)
            setattr(self, name, packed_heads)


class DeepseekV3DecoderLayer(nn.Module):
    def __init__(self, cfg: DeepseekV3ModelConfig, layer_idx: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = cfg.rms_norm_eps
        self.input_layernorm = param(cfg.hidden_size, dtype=dtype)
        self.self_attn = MlaAttention(cfg, dtype)
        self.post_attention_layernorm = param(cfg.hidden_size, dtype=dtype)
        self.mlp: nn.Module = (SwiGLU(cfg.hidden_size, cfg.intermediate_size, dtype)
                               if cfg.moe is None or layer_idx < cfg.first_k_dense_replace
                               else MoE(cfg.hidden_size, cfg.moe, dtype))

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor, rope: MlaRope,
                meta: AttentionMetadata, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """vLLM's residual stream, as LlamaDecoderLayer: returns (MLP output, residual)."""
        if residual is None:
            residual, x = h, ops.rms_norm(h, self.input_layernorm, self.eps)
        else:
            x, residual = ops.fused_add_rms_norm(h, residual, self.input_layernorm, self.eps)
        attn = self.self_attn(x, positions, rope, meta, kv_cache)
        x, residual = ops.fused_add_rms_norm(attn, residual, self.post_attention_layernorm, self.eps)
        return self.mlp(x), residual

    def weight_targets(self, prefix: str) -> WeightTargets:
        targets = self.self_attn.weight_targets(prefix + "self_attn.")
        targets.update(self.mlp.weight_targets(prefix + "mlp."))  # type: ignore[operator]
        for norm in ("input_layernorm", "post_attention_layernorm"):
            targets[f"{prefix}{norm}.weight"] = (getattr(self, norm), getattr(self, norm))
        return targets

    def pack(self, pack: Callable[[torch.Tensor], Any], pack_router: Callable[[torch.Tensor], Any] | None) -> None:
        self.self_attn.pack(pack)
        if isinstance(self.mlp, MoE):
            self.mlp.pack(pack, pack_router)
        else:
            self.mlp.pack(pack)  # type: ignore[operator]


def kv_b_transform(layers: dict[str, MlaAttention]) -> Callable[[str, torch.Tensor], torch.Tensor]:
    """load_named_weights' transform: a kv_b_proj tensor becomes W_UK (and fills W_UV)."""
    def transform(name: str, tensor: torch.Tensor) -> torch.Tensor:
        attn = layers.get(name)
        if attn is None:
            return tensor
        expected = (attn.num_heads * (attn.nope + attn.v_dim), attn.rank)
        if tuple(tensor.shape) != expected:
            raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != expected {expected}")
        return attn.load_kv_b(tensor)
    return transform


class DeepseekV3ForCausalLM(nn.Module):
    @property
    def batch_invariant_on_cuda(self) -> bool:
        """Under KernelConfig.batch_invariant every GEMM on CUDA is one of pyengine's invariant ones
        (the projections and the fp32 router through linear(), the per-head W_UK / W_UV and the
        routed experts through ops.grouped_linear; routing ties and the experts' combine follow
        per-row rules), and attention is the MLA kernel's with one key split per row: fp16/bf16 at
        the kernel's widths. Elsewhere the MLA reference runs, whose einsums are torch's GEMMs."""
        return self.dtype in (torch.float16, torch.bfloat16) and self.mla_kernel_widths

    @property
    def supports_cuda_graphs(self) -> bool:
        return moe_graphable(self.layers, self.dtype)

    @property
    def mla_kernel_widths(self) -> bool:
        """Whether the latent rows have the CUDA MLA kernel's widths (else the reference runs)."""
        return (self.config.kv_lora_rank, self.config.qk_rope_head_dim) == (512, 64)

    def __init__(self, config: DeepseekV3ModelConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config, self.dtype = config, dtype
        self.embed_tokens = param(config.vocab_size, config.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(DeepseekV3DecoderLayer(config, i, dtype) for i in range(config.num_hidden_layers))
        self.norm = param(config.hidden_size, dtype=dtype)
        self.lm_head: Any = param(config.hidden_size, config.vocab_size, dtype=dtype)
        self.rope = MlaRope(config)
        self.mtp: nn.Module | None = None
        if config.load_mtp:
            from pyengine.models.deepseek_mtp import DeepseekMtp

            self.mtp = DeepseekMtp(self, dtype)
        self.owns_cpu_threads = False

    def make_kv_caches(self, num_blocks: int, block_size: int, device: torch.device) -> list[torch.Tensor]:
        """One latent cache [blocks, block_size, R + P] per layer."""
        width = self.config.kv_lora_rank + self.config.qk_rope_head_dim
        return [torch.empty(num_blocks, block_size, width, dtype=self.dtype, device=device)
                for _ in range(self.config.num_hidden_layers)]

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """input_ids/positions [T] -> final-norm hidden states [T, hidden]."""
        h, residual = F.embedding(input_ids, self.embed_tokens), None
        for layer, kv_cache in zip(self.layers, kv_caches):
            h, residual = layer(h, residual, positions, self.rope, meta, kv_cache)
        assert residual is not None
        return ops.fused_add_rms_norm(h, residual, self.norm, self.config.rms_norm_eps)[0]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear(hidden, self.lm_head).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """HF-named tensors (fp8 ones already dequantised by the loader) into the parameters; with
        load_mtp off, the MTP layers' tensors are skipped. Every parameter must be covered."""
        n = self.config.num_hidden_layers
        attn = {f"model.layers.{i}.self_attn.kv_b_proj.weight": layer.self_attn for i, layer in enumerate(self.layers)}
        if self.mtp is not None:
            attn.update(self.mtp.kv_b_layers())  # type: ignore[operator]

        def wanted(items: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in items:
                parts = name.split(".")
                if len(parts) > 3 and parts[1] == "layers" and parts[2].isdigit() and int(parts[2]) >= n:
                    if self.mtp is None or int(parts[2]) > n or self.mtp.take_optional(name, tensor):  # type: ignore[operator]
                        continue  # MTP layers: unused without MTP speculation, the first one only, or kept as is
                yield name, tensor

        load_named_weights(self, decoder_weight_targets(self), wanted(weights), tied=False,
                           transform=kv_b_transform(attn))

    def prepack_for_cpu(self) -> bool:
        """Every linear on the CPU's packed GEMM (PackedLinear where this CPU runs it: batch-invariant;
        per-head W_UK / W_UV as one packed weight per head), as LlamaForCausalLM.prepack_for_cpu."""
        if self.embed_tokens.device.type != "cpu":
            return False
        pack = cpu_linear_packer(self.embed_tokens)
        if pack is None:
            return False
        pack_router = cpu_linear_packer(torch.zeros(2, 2))
        modules = list(self.layers) + ([] if self.mtp is None else [self.mtp])
        for module in modules:
            module.pack(pack, pack_router)  # type: ignore[operator]
        pack_weights(self, ("lm_head",), pack)
        self.owns_cpu_threads = pack is not onednn_prepack
        self.packed_lm_head = self.lm_head
        return True
