"""The Llama family (Llama 2/3, SmolLM, Qwen2 with qkv bias, Qwen3 with per-head q/k RMSNorm).

One flat token batch [T] runs through the decoder; every layer appends its new K/V to the paged
cache (ops.reshape_and_cache) and attends over it (ops.paged_attention). Projections are fused
(q|k|v -> qkv_proj, gate|up -> gate_up_proj) so a layer is a handful of large matmuls.

Linear weights are stored transposed, [in, out], and applied as x @ W: small-batch decode is
memory-bound and MKL streams that layout ~25% faster than F.linear's [out, in] at batch 1-16
(measured on SmolLM2-135M, 2 cores). On an H100 (bf16, in CUDA graphs) it is also the faster one
for cuBLAS overall: on the Llama-3-8B projections at M = 1..64, F.linear's [out, in] wins only qkv
at M = 2..5 (and by < 2% at 64), and is 2-15% slower on o, gate_up, down and lm_head
(benchmarks/bench_gemm_layouts.py). At decode batch sizes on CUDA, linear() runs pyengine's own
skinny GEMM on that layout instead (pyengine.ops.skinny_linear: no split-K reduce kernel, and a
row's result independent of the batch; benchmarks/bench_skinny_gemm.py). A tied lm_head is kept
only once, as [hidden, vocab]; token embedding then gathers its columns.
"""
from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pyengine import ops
from pyengine.engine.attention_metadata import AttentionMetadata
from pyengine.config import ModelConfig

KVCache = tuple[torch.Tensor, torch.Tensor]
_LINEAR_NAMES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def linear(x: torch.Tensor, w: torch.Tensor | Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor],
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W (+ bias) for a dense [in, out] weight, a oneDNN-prepacked one, or a
    pyengine.ops.cpu.PackedLinear (see prepack_for_cpu)."""
    if not isinstance(w, torch.Tensor):
        return w(x, bias)
    if w.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")
    if w.is_cuda:
        y = ops.skinny_linear(x, w, bias)
        if y is not None:
            return y
    return torch.mm(x, w) if bias is None else torch.addmm(bias, x, w)


def _prepack(w: torch.Tensor) -> torch.Tensor:
    """[in, out] dense -> oneDNN's blocked layout of the [out, in] weight."""
    return torch.ops.mkldnn._reorder_linear_weight(w.t().contiguous(), None)


def _inv_freq(config: ModelConfig) -> torch.Tensor:
    """RoPE inverse frequencies (float64), with llama3 / linear scaling applied."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "freq_factors":  # GGUF rope_freqs.weight: llama3 divisors, precomputed
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float64)
    factor = float(scaling.get("factor", 1.0))
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    # llama3: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    original = float(scaling.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= original / high) & (wavelen <= original / low)
    return torch.where(medium, blended, scaled)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention then (optionally) a pre-norm SwiGLU MLP, each added to the residual.
    Hybrid models reuse the attention half on its own (mlp=False: no MLP parameters)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, mlp: bool = True) -> None:
        super().__init__()
        hq, hkv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        hidden, inter = config.hidden_size, config.intermediate_size
        self.num_heads, self.num_kv_heads, self.head_dim = hq, hkv, d
        self.eps = config.rms_norm_eps
        self.scale = d**-0.5

        def param(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)

        self.input_layernorm = param(hidden)
        self.qkv_proj = param(hidden, (hq + 2 * hkv) * d)  # [in, out], see module docstring
        self.qkv_bias = param((hq + 2 * hkv) * d) if config.attention_bias else None
        # Qwen3: q_norm and k_norm stacked per head so one rms_norm + one mul covers q and k.
        self.qk_norm = param(hq + hkv, d) if config.qk_norm else None
        self.o_proj = param(hq * d, hidden)
        self.post_attention_layernorm = param(hidden) if mlp else None
        self.gate_up_proj = param(hidden, 2 * inter) if mlp else None
        self.down_proj = param(inter, hidden) if mlp else None
        self.intermediate_size = inter

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor | None,
                sin: torch.Tensor | None, meta: AttentionMetadata,
                kv_cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """vLLM's residual stream: h is the previous layer's MLP output and residual the sum before
        it (None at the first layer, where h is the embedding). Returns (this layer's MLP output,
        residual); the caller adds the last pair. The adds are fused into the norms."""
        if residual is None:
            residual, x = h, ops.rms_norm(h, self.input_layernorm, self.eps)
        else:
            x, residual = ops.fused_add_rms_norm(h, residual, self.input_layernorm, self.eps)
        attn = self.self_attention(x, cos, sin, meta, kv_cache)
        x, residual = ops.fused_add_rms_norm(attn, residual, self.post_attention_layernorm, self.eps)
        return self.swiglu(x), residual

    def attention(self, h: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None,
                  meta: AttentionMetadata, kv_cache: KVCache) -> torch.Tensor:
        """h + attention(norm(h)), for hybrid models that use the attention half on its own."""
        return h + self.self_attention(ops.rms_norm(h, self.input_layernorm, self.eps), cos, sin, meta, kv_cache)

    def self_attention(self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None,
                       meta: AttentionMetadata, kv_cache: KVCache) -> torch.Tensor:
        """o_proj(attention(x)) for normed x [T, hidden]: writes this step's K/V, then reads the
        paged context. cos/sin [T, head_dim] (rotate_half's sign folded into sin), None: no RoPE."""
        t = x.shape[0]
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = linear(x, self.qkv_proj, self.qkv_bias)
        qk = qkv[:, : (hq + hkv) * d].view(t, hq + hkv, d)  # strided rows: q|k|v stay in one buffer
        v = qkv[:, (hq + hkv) * d :].view(t, hkv, d)
        if self.qk_norm is not None:
            qk = (F.rms_norm(qk, (d,), None, self.eps) * self.qk_norm).contiguous()
        ops.rope_and_cache(qk, v, cos, sin, kv_cache[0], kv_cache[1], meta.slot_mapping)
        attn = ops.paged_attention(qk[:, :hq], kv_cache[0], kv_cache[1], meta, self.scale)
        assert isinstance(attn, torch.Tensor)
        return linear(attn.reshape(t, hq * d), self.o_proj)

    def swiglu(self, x: torch.Tensor) -> torch.Tensor:
        """down(silu(gate(x)) * up(x)) for normed x."""
        return linear(ops.silu_and_mul(linear(x, self.gate_up_proj)), self.down_proj)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        vocab, hidden = config.vocab_size, config.hidden_size
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, dtype) for _ in range(config.num_hidden_layers))
        self.norm = nn.Parameter(torch.empty(hidden, dtype=dtype), requires_grad=False)
        self.lm_head = nn.Parameter(torch.empty(hidden, vocab, dtype=dtype), requires_grad=False)  # [in, out]
        # Untied: a row-major [vocab, hidden] table. Tied: None, rows come from lm_head's columns.
        self.embed_tokens = (
            None if config.tie_word_embeddings else nn.Parameter(torch.empty(vocab, hidden, dtype=dtype), requires_grad=False)
        )
        # cos/sin for every position, computed once in float64 then cast: [max_pos, head_dim].
        positions = torch.arange(config.max_position_embeddings, dtype=torch.float64)
        freqs = torch.outer(positions, _inv_freq(config))
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("rope_cos", emb.cos().to(dtype), persistent=False)
        sin = emb.sin()
        sin[:, : config.head_dim // 2] *= -1  # rotate_half(x) = (-x2, x1); see the layer's RoPE
        self.register_buffer("rope_sin", sin.to(dtype), persistent=False)

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
        cos = self.rope_cos.index_select(0, positions)  # [T, D], shared by all heads and layers
        sin = self.rope_sin.index_select(0, positions)
        stack = self.__dict__.get("_cpu_stack")  # CPU: every layer in one C++ call, see prepack_for_cpu
        if stack is not None and stack.applies(meta, kv_caches):
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
    def lm_logits_weight(self) -> torch.Tensor:
        packed = self.__dict__.get("_packed_lm_head")
        return self.lm_head if packed is None else packed

    def prepack_for_cpu(self) -> bool:
        """Swap every linear weight for a packed copy (CPU only, after load_weights): on AVX-512
        CPUs (avx512_bf16 for bf16) pyengine's own GEMM (pyengine.ops.cpu.PackedLinear), else a
        oneDNN-prepacked weight.

        benchmarks/bench_cpu_gemm.py (SmolLM2-135M shapes, GGUF-quantised values, 2 cores;
        results/cpu_gemm.json), all linears of one step: fp32 compact panels 11.7 ms at batch 16 and
        4.5 at batch 1 (dense panels 18.1 / 11.1, oneDNN 18.4 / 13.3); bf16 8.2 vs oneDNN 10.9 at
        batch 16 and 5.7 vs 7.5 at batch 1. Dense fp32 keeps the packed GEMM for its
        batch-invariant rows even near a tie.
        Returns False (model unchanged) where neither is available. The dense copies are dropped,
        so load_weights cannot run again."""
        if self.lm_head.device.type != "cpu":
            return False
        pack = self._cpu_packer()
        if pack is None:
            return False
        for layer in self.layers:
            for name in _LINEAR_NAMES:
                packed = pack(getattr(layer, name).detach())
                delattr(layer, name)  # drop the Parameter; a plain attribute takes its name
                setattr(layer, name, packed)
        # lm_head stays dense as well when tied: token embedding gathers from it.
        self.__dict__["_packed_lm_head"] = pack(self.lm_head.detach())
        if self.embed_tokens is not None:
            self.lm_head.data = torch.empty(0, dtype=self.dtype)
        self.owns_cpu_threads = pack is not _prepack  # see ModelRunner.step_threads
        if self.owns_cpu_threads and os.environ.get("PYENGINE_CPU_STACK", "1") != "0":
            from pyengine.models.llama_cpu_stack import CpuLlamaStack

            self.__dict__["_cpu_stack"] = CpuLlamaStack.build(self)  # None: layers the C++ loop does not cover
        return True

    def _cpu_packer(self) -> Callable[[torch.Tensor], Any] | None:
        """pyengine's PackedLinear where this CPU runs it, else oneDNN's prepack, else None."""
        if ops.cpu_kernels_enabled():
            try:
                from pyengine.ops.cpu import PackedLinear
            except ImportError:
                PackedLinear = None
            if PackedLinear is not None and PackedLinear.supported(self.lm_head):
                return PackedLinear
        if not torch.backends.mkldnn.is_available():
            return None
        try:
            linear(torch.zeros(1, 2, dtype=self.dtype), _prepack(torch.zeros(2, 2, dtype=self.dtype)))
        except (RuntimeError, NotImplementedError):
            return None
        return _prepack

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
            assert isinstance(layer, LlamaDecoderLayer)
            transposed.update(id(p) for p in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj))
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
