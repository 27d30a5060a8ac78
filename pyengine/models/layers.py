"""Layers the model files share: linear, rotary embedding, the Llama decoder layer and the Mamba2 mixer.

Linear weights are stored transposed, [in, out], and applied as x @ W (see linear); the loaders
copy HF's [out, in] tensors through transposed views.
"""
from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pyengine import ops
from pyengine.ops.kernel_config import get_kernel_config
from pyengine.ops.rowwise import rowwise  # noqa: F401 (models import it from here)
from pyengine.config import Mamba2ModelConfig, ModelConfig
from pyengine.engine.attention_metadata import AttentionMetadata
from pyengine.engine.state_cache import StateMetadata

KVCache = tuple[torch.Tensor, torch.Tensor]
# HF checkpoint name -> the tensor it fills, as a view in HF orientation ([out, in] for linears)
WeightTargets = dict[str, tuple[torch.Tensor, torch.Tensor]]


def param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    """An uninitialised frozen parameter: load_weights fills every one."""
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


def linear(x: torch.Tensor, w: torch.Tensor | Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor],
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W (+ bias) for a dense [in, out] weight, a oneDNN-prepacked one, or a
    pyengine.ops.cpu.PackedLinear (LlamaForCausalLM.prepack_for_cpu). On CUDA pyengine's GEMMs take
    what they take (ops.linear: single rows, or every call under KernelConfig.batch_invariant),
    cuBLAS the rest."""
    if not isinstance(w, torch.Tensor):
        return w(x, bias)
    if w.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")
    if w.is_cuda:
        y = ops.linear(x, w, bias)
        if y is not None:
            return y
    return torch.mm(x, w) if bias is None else torch.addmm(bias, x, w)


def hf_linear(x: torch.Tensor, w: torch.Tensor | Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor],
              bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w^T (+ bias) for a dense weight kept in HF's [out, in] orientation (the Mamba2 mixer's),
    or what prepack_for_cpu / prepack_for_cuda (pyengine/models/hybrid.py) made of its [in, out]
    transpose (see linear). A dense CUDA weight under KernelConfig.batch_invariant is an error:
    F.linear would run cuBLAS, whose kernel changes with the number of rows."""
    if isinstance(w, torch.Tensor) and not w.is_mkldnn:
        if w.is_cuda and get_kernel_config().batch_invariant:
            raise ValueError("batch_invariant: an [out, in] projection on CUDA must go through prepack_for_cuda "
                             "(pyengine's invariant GEMM), not F.linear")
        return F.linear(x, w, bias)
    return linear(x, w, bias)


def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each row of a 2-D x (F.rms_norm's semantics). On CUDA pyengine's kernel
    (ops.rms_norm: a block per row, launched by the row width alone), because torch's CUDA
    reductions lay out their threads by the number of rows, so a row's sum would change with the
    batch; elsewhere F.rms_norm, whose CPU rows are independent."""
    if x.is_cuda:
        return ops.rms_norm(x, weight, eps)
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


@functools.lru_cache(maxsize=None)
def unit_weight(width: int, device: torch.device) -> torch.Tensor:
    """fp32 ones [width]: the weight of a plain RMSNorm through rms_norm_rows (x * 1 is exact),
    made once per width and device rather than at every call."""
    return torch.ones(width, dtype=torch.float32, device=device)


def onednn_prepack(w: torch.Tensor) -> torch.Tensor:
    """[in, out] dense -> oneDNN's blocked layout of the [out, in] weight."""
    return torch.ops.mkldnn._reorder_linear_weight(w.t().contiguous(), None)


def cpu_linear_packer(sample: torch.Tensor) -> Callable[[torch.Tensor], Any] | None:
    """How a CPU model packs its [in, out] linear weights (sample: one of them, for the dtype):
    pyengine's PackedLinear where this CPU runs it (batch-invariant), else oneDNN's prepack, else
    None (keep the dense weights)."""
    if ops.cpu_kernels_enabled():
        try:
            from pyengine.ops.cpu import PackedLinear
        except ImportError:
            PackedLinear = None
        if PackedLinear is not None and PackedLinear.supported(sample):
            return PackedLinear
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        linear(torch.zeros(1, 2, dtype=sample.dtype), onednn_prepack(torch.zeros(2, 2, dtype=sample.dtype)))
    except (RuntimeError, NotImplementedError):
        return None
    return onednn_prepack


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """torch at one thread for the block: its OpenMP workers otherwise wake and spin on cores that
    pyengine's own CPU thread pool (the packed GEMM) or a memory-bound copy needs."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def pack_weights(module: nn.Module, names: Iterable[str], pack: Callable[[torch.Tensor], Any]) -> None:
    """Replace module's [in, out] weights `names` (those present, not None and not packed already:
    a oneDNN-packed weight is an mkldnn tensor) by pack(weight); the dense parameters go
    (prepack_for_cpu)."""
    for name in names:
        w = getattr(module, name, None)
        if isinstance(w, torch.Tensor) and not w.is_mkldnn:
            packed = pack(w.detach())
            delattr(module, name)
            setattr(module, name, packed)


def rope_inv_freq(rotary_dim: int, rope_theta: float, rope_scaling: dict[str, Any] | None) -> torch.Tensor:
    """RoPE inverse frequencies (float64) of rotary_dim dims, with llama3 / linear / YaRN scaling applied."""
    inv_freq = 1.0 / (rope_theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    if rope_scaling is None:
        return inv_freq
    if rope_scaling["rope_type"] == "freq_factors":  # GGUF rope_freqs.weight: llama3 divisors, precomputed
        return inv_freq / torch.tensor(rope_scaling["factors"], dtype=torch.float64)
    factor = float(rope_scaling.get("factor", 1.0))
    if rope_scaling["rope_type"] == "linear":
        return inv_freq / factor
    if rope_scaling["rope_type"] == "yarn":
        return yarn_inv_freq(inv_freq, rotary_dim, rope_theta, rope_scaling)
    # llama3: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    low = float(rope_scaling.get("low_freq_factor", 1.0))
    high = float(rope_scaling.get("high_freq_factor", 4.0))
    original = float(rope_scaling.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= original / high) & (wavelen <= original / low)
    return torch.where(medium, blended, scaled)


def yarn_inv_freq(inv_freq: torch.Tensor, rotary_dim: int, rope_theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """YaRN (arXiv 2309.00071): dims that turn fewer than beta_slow times over the original context
    are interpolated (divided by factor), those turning more than beta_fast times kept, with a
    linear ramp between them over the dim index."""
    factor = float(scaling["factor"])
    original = float(scaling["original_max_position_embeddings"])
    beta_fast, beta_slow = float(scaling.get("beta_fast") or 32), float(scaling.get("beta_slow") or 1)

    def dim_of(rotations: float) -> float:  # the dim index that turns `rotations` times over `original`
        return rotary_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(rope_theta))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_attention_factor(rope_scaling: dict[str, Any] | None) -> float:
    """The factor YaRN applies to cos and sin (1 for every other scaling)."""
    if rope_scaling is None or rope_scaling["rope_type"] != "yarn":
        return 1.0
    if rope_scaling.get("attention_factor") is not None:
        return float(rope_scaling["attention_factor"])
    factor = float(rope_scaling["factor"])
    mscale, mscale_all_dim = rope_scaling.get("mscale"), rope_scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, float(mscale)) / yarn_mscale(factor, float(mscale_all_dim))
    return yarn_mscale(factor)


class RotaryEmbedding(nn.Module):
    """cos, sin [T, head_dim] for ops.rope_and_cache, which rotates the pairs (j, j + head_dim/2):
    rotate_half's sign is folded into sin, and with rotary_dim < head_dim the last dims of each half
    pass through (cos 1, sin 0). With max_positions the table of every position is computed once in
    float64; without, each call computes its positions' rows on their device."""

    def __init__(self, head_dim: int, rotary_dim: int, rope_theta: float, rope_scaling: dict[str, Any] | None,
                 dtype: torch.dtype, max_positions: int | None = None) -> None:
        super().__init__()
        if rotary_dim % 2 or rotary_dim > head_dim or rotary_dim <= 0:
            raise ValueError(f"rotary dim {rotary_dim} must be even and in (0, head_dim={head_dim}]")
        self.head_dim, self.dtype = head_dim, dtype
        self.attention_factor = rope_attention_factor(rope_scaling)
        self.register_buffer("inv_freq", rope_inv_freq(rotary_dim, rope_theta, rope_scaling), persistent=False)
        cos = sin = None
        if max_positions is not None:
            cos, sin = self.compute(torch.arange(max_positions, dtype=torch.float64))
        self.cos_table: torch.Tensor | None
        self.sin_table: torch.Tensor | None
        self.register_buffer("cos_table", cos, persistent=False)
        self.register_buffer("sin_table", sin, persistent=False)

    def compute(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows of `positions`: cos and sin in float64, scaled, then rounded once to dtype. Only
        the rotary_dim / 2 distinct values per row are computed and rounded; the halves and the
        pass-through dims are assembled in dtype (rounding commutes with negation and copying, and
        x * 1.0 == x: the same bits as assembling in float64 first, at a fraction of the memory
        traffic: most of the cost of the default model's 8192-position table)."""
        d2, r2 = self.head_dim // 2, self.inv_freq.shape[0]
        angles = positions.to(torch.float64)[:, None] * self.inv_freq  # [T, rotary_dim / 2]
        c, s = angles.cos(), angles.sin()
        if self.attention_factor != 1.0:
            c, s = c * self.attention_factor, s * self.attention_factor
        c, s = c.to(self.dtype), s.to(self.dtype)
        if r2 == d2:
            return torch.cat([c, c], dim=1), torch.cat([-s, s], dim=1)
        ones, zeros = c.new_ones(c.shape[0], d2 - r2), s.new_zeros(s.shape[0], d2 - r2)
        return torch.cat([c, ones, c, ones], dim=1), torch.cat([-s, zeros, s, zeros], dim=1)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.cos_table is None or self.sin_table is None:
            return self.compute(positions)
        return self.cos_table.index_select(0, positions), self.sin_table.index_select(0, positions)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention then (optionally) a pre-norm SwiGLU MLP, each added to the residual.
    Projections are fused (q|k|v -> qkv_proj, gate|up -> gate_up_proj). Hybrid models reuse the
    attention half on its own (mlp=False: no MLP parameters)."""

    LINEAR_NAMES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")

    def __init__(self, config: ModelConfig, dtype: torch.dtype, mlp: bool = True) -> None:
        super().__init__()
        hq, hkv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        hidden, inter = config.hidden_size, config.intermediate_size
        self.num_heads, self.num_kv_heads, self.head_dim = hq, hkv, d
        self.eps = config.rms_norm_eps
        self.scale = d**-0.5
        self.input_layernorm = param(hidden, dtype=dtype)
        self.qkv_proj = param(hidden, (hq + 2 * hkv) * d, dtype=dtype)
        self.qkv_bias = param((hq + 2 * hkv) * d, dtype=dtype) if config.attention_bias else None
        # Qwen3: q_norm and k_norm stacked per head so one rms_norm + one mul covers q and k.
        self.qk_norm = param(hq + hkv, d, dtype=dtype) if config.qk_norm else None
        self.o_proj = param(hq * d, hidden, dtype=dtype)
        self.post_attention_layernorm = param(hidden, dtype=dtype) if mlp else None
        self.gate_up_proj = param(hidden, 2 * inter, dtype=dtype) if mlp else None
        self.down_proj = param(inter, hidden, dtype=dtype) if mlp else None
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
        paged context. cos/sin [T, head_dim] (RotaryEmbedding), None: no RoPE."""
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

    def pack(self, pack: Callable[[torch.Tensor], Any]) -> None:
        """prepack_for_cpu of the hybrid models: every projection this layer has, packed."""
        pack_weights(self, self.LINEAR_NAMES, pack)

    def attention_weight_targets(self, prefix: str) -> WeightTargets:
        """HF q/k/v/o projection weights under `prefix` (e.g. "model.layers.3.self_attn.")."""
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj.t()
        return {prefix + "q_proj.weight": (self.qkv_proj, qkv.narrow(0, 0, hq * d)),
                prefix + "k_proj.weight": (self.qkv_proj, qkv.narrow(0, hq * d, hkv * d)),
                prefix + "v_proj.weight": (self.qkv_proj, qkv.narrow(0, (hq + hkv) * d, hkv * d)),
                prefix + "o_proj.weight": (self.o_proj, self.o_proj.t())}


class Mamba2Mixer(nn.Module):
    """in_proj -> [gate z | xBC | dt]; causal depthwise conv over xBC (silu); SSM over x with B, C
    (groups), dt (softplus + dt_bias), A = -exp(A_log), skip D; gated group RMSNorm (y * silu(z));
    out_proj. Recurrent state lives in the runner's StateCache: decode/verify rows (the first
    num_decode_rows, any T = 1 + drafts) run causal_conv1d_update + selective_state_update reading
    slot / offset a - 1; prefill rows run causal_conv1d_fn + ssd_chunk_scan (the CUDA and CPU
    backends: the decode recurrence token after token, so a token's bits never depend on the step)."""

    # HF checkpoint name (under the mixer's prefix) -> parameter
    HF_NAMES = {"in_proj.weight": "in_proj", "in_proj.bias": "in_proj_bias", "conv1d.weight": "conv_weight",
                "conv1d.bias": "conv_bias", "dt_bias": "dt_bias", "A_log": "A_log", "D": "D",
                "norm.weight": "norm", "out_proj.weight": "out_proj", "out_proj.bias": "out_proj_bias"}

    def __init__(self, cfg: Mamba2ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.state_size = cfg.num_ssm_heads, cfg.ssm_head_dim, cfg.state_size
        self.n_groups, self.width, self.chunk_size = cfg.n_groups, cfg.conv_kernel, cfg.chunk_size
        self.inner = cfg.num_ssm_heads * cfg.ssm_head_dim
        self.conv_dim = self.inner + 2 * cfg.n_groups * cfg.state_size
        self.eps, self.dt_limit = cfg.rms_norm_eps, cfg.time_step_limit
        # HF [out, in]; prepack_for_cpu replaces both projections by packed callables (hf_linear)
        self.in_proj: Any = param(self.inner + self.conv_dim + self.num_heads, cfg.hidden_size, dtype=dtype)
        self.in_proj_bias = param(self.in_proj.shape[0], dtype=dtype) if cfg.use_bias else None
        self.conv_weight = param(self.conv_dim, self.width, dtype=dtype)
        self.conv_bias = param(self.conv_dim, dtype=dtype) if cfg.use_conv_bias else None
        self.dt_bias = param(self.num_heads, dtype=dtype)
        self.A_log = param(self.num_heads, dtype=dtype)
        self.D = param(self.num_heads, dtype=dtype)
        self.norm = param(self.inner, dtype=dtype)
        self.out_proj: Any = param(cfg.hidden_size, self.inner, dtype=dtype)
        self.out_proj_bias = param(cfg.hidden_size, dtype=dtype) if cfg.use_bias else None

    def state_shape(self, k: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return (self.width - 1 + k, self.conv_dim), (self.num_heads, self.head_dim, self.state_size)

    def weight_targets(self, prefix: str) -> WeightTargets:
        return {prefix + hf: (p, p) for hf, ours in self.HF_NAMES.items() if (p := getattr(self, ours)) is not None}

    def pack(self, pack: Callable[[torch.Tensor], Any]) -> None:
        """prepack_for_cpu: in_proj and out_proj (HF [out, in]) packed as their [in, out] transposes."""
        pack_weights(self, ("in_proj", "out_proj"), lambda w: pack(w.t()))

    def forward(self, h: torch.Tensor, state: StateMetadata, conv_state: torch.Tensor,
                ssm_state: torch.Tensor) -> torch.Tensor:
        t, nd = h.shape[0], state.num_decode_tokens
        gate, xbc, dt = hf_linear(h, self.in_proj, self.in_proj_bias).split(
            [self.inner, self.conv_dim, self.num_heads], dim=-1)
        xbc = xbc.contiguous()
        conv_out = torch.empty_like(xbc)
        dec_qsl, dec_idx, dec_acc = state.decode_rows()
        pre_qsl, pre_idx, pre_acc, pre_init = state.prefill_rows()
        if state.num_decode_rows:
            conv_out[:nd] = ops.causal_conv1d_update(xbc[:nd], conv_state, self.conv_weight, self.conv_bias,
                                                     dec_qsl, dec_idx, dec_acc, "silu")
        if nd < t:
            conv_out[nd:] = ops.causal_conv1d_fn(xbc[nd:], conv_state, self.conv_weight, self.conv_bias,
                                                 pre_qsl, pre_idx, pre_acc, pre_init, "silu")
        x, B, C = conv_out.split([self.inner, self.n_groups * self.state_size, self.n_groups * self.state_size], -1)
        x = x.reshape(t, self.num_heads, self.head_dim)
        B = B.reshape(t, self.n_groups, self.state_size)
        C = C.reshape(t, self.n_groups, self.state_size)
        dt = dt.contiguous()
        A = -torch.exp(self.A_log.float())
        y = torch.empty_like(x)
        if state.num_decode_rows:
            y[:nd] = ops.selective_state_update(ssm_state, x[:nd], dt[:nd], A, B[:nd], C[:nd], self.D, None,
                                                self.dt_bias, dec_qsl, dec_idx, dec_acc, True, self.dt_limit)
        if nd < t:
            y[nd:] = ops.ssd_chunk_scan(x[nd:], dt[nd:], A, B[nd:], C[nd:], self.D, None, self.dt_bias, pre_qsl,
                                        ssm_state, pre_idx, pre_acc, pre_init, self.chunk_size, True, self.dt_limit)
        # gated group RMSNorm (HF MambaRMSNormGated, norm_before_gate=False), fp32
        g = y.reshape(t, self.inner).float() * rowwise(F.silu, gate.float())
        if g.is_cuda:  # one normalised row per group; weight 1 (exact): torch's reductions are not row-invariant there
            group = self.inner // self.n_groups
            g = rms_norm_rows(g.view(t * self.n_groups, group), unit_weight(group, g.device), self.eps)
        else:
            g = g.view(t, self.n_groups, -1)
            g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        g = self.norm * g.view(t, self.inner).to(h.dtype)
        return hf_linear(g, self.out_proj, self.out_proj_bias)


class Mamba2Block(nn.Module):
    """h + mixer(RMSNorm(h)): a Mamba2 layer (HF names: prefix norm.weight, prefix mixer.*)."""

    def __init__(self, config: Mamba2ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = config.rms_norm_eps
        self.norm = param(config.hidden_size, dtype=dtype)
        self.mixer = Mamba2Mixer(config, dtype)

    def forward(self, h: torch.Tensor, state: StateMetadata, conv_state: torch.Tensor,
                ssm_state: torch.Tensor) -> torch.Tensor:
        return h + self.mixer(rms_norm_rows(h, self.norm, self.eps), state, conv_state, ssm_state)

    def weight_targets(self, prefix: str) -> WeightTargets:
        return {prefix + "norm.weight": (self.norm, self.norm), **self.mixer.weight_targets(prefix + "mixer.")}

    def pack(self, pack: Callable[[torch.Tensor], Any]) -> None:
        self.mixer.pack(pack)
