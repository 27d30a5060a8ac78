"""The ops of the models: each validated once here, then run by the backend of the tensors' device.

Backends, one module per kernel family in each (attention, mla, layer, gemm, ssm):
  pyengine.ops.cuda       the kernels of hipkernels/ (CUDA tensors, when the extension has them)
  pyengine.ops.cpu        the C++ loops of csrc/cpu/ (CPU tensors, while KernelConfig.cpu_kernels)
  pyengine.ops.reference  PyTorch: the executable spec, and whatever no backend takes
A backend only prepares layouts and pointers; where it lacks an op, or a dtype, the reference runs,
so a partially built stack still produces correct results. Kernel choices (KernelConfig) are read
at each call: see pyengine.ops.kernel_config.
"""
from __future__ import annotations

from types import ModuleType
from typing import Any

import torch

from pyengine.engine.attention_metadata import AttentionMetadata
from pyengine.ops import reference
from pyengine.ops.kernel_config import get_kernel_config
from pyengine.ops.reference import PAD
from pyengine.ops.reference.mla import KV_LORA_RANK

__all__ = ["paged_attention", "paged_attention_mla", "reshape_and_cache_mla", "rms_norm", "fused_add_rms_norm",
           "silu_and_mul", "rope_and_cache", "linear", "grouped_linear", "causal_conv1d_update", "causal_conv1d_fn",
           "selective_state_update", "ssd_chunk_scan", "gated_delta_rule_update", "gated_delta_rule_chunked",
           "gated_delta_rule_prefill", "gated_delta_rule_materialise", "copy_state", "normalize_state", "PAD",
           "cpu_kernels_enabled"]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_backends: dict[str, ModuleType | None] = {}


def _load(device_type: str) -> ModuleType | None:
    """The backend package for a device type, imported once (None: not built)."""
    if device_type not in _backends:
        try:
            if device_type == "cuda":
                from pyengine.ops import cuda as backend
            else:
                from pyengine.ops import cpu as backend
        except ImportError:
            backend = None
        _backends[device_type] = backend
    return _backends[device_type]


def _backend(device: torch.device) -> ModuleType:
    if device.type == "cuda" or (device.type == "cpu" and cpu_kernels_enabled()):
        return _load(device.type) or reference
    return reference


def cpu_kernels_enabled() -> bool:
    """KernelConfig.cpu_kernels: False keeps CPU models on the PyTorch references and oneDNN."""
    return get_kernel_config().cpu_kernels


def _impl(device: torch.device, name: str) -> Any:
    """The backend's op `name`, or the reference's where the backend lacks it."""
    return getattr(_backend(device), name, None) or getattr(reference, name)


def _check_same_device(*tensors: torch.Tensor | None) -> None:
    present = [t for t in tensors if t is not None]
    device = present[0].device
    for t in present[1:]:
        if t.device != device:
            raise ValueError(f"all tensors must be on one device, got {device} and {t.device}")


def _check_cache(name: str, cache: torch.Tensor, dims: int = 4) -> None:
    if cache.dim() != dims:
        layout = "[num_blocks, block_size, num_kv_heads, head_dim]" if dims == 4 else "[num_blocks, block_size, width]"
        raise ValueError(f"{name} must be {layout}, got {tuple(cache.shape)}")
    if cache.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name} dtype {cache.dtype} is not a float type")
    if not cache.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def _check_kv_caches(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    _check_cache("k_cache", k_cache)
    _check_cache("v_cache", v_cache)
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ")


def _check_slots(slot_mapping: torch.Tensor, num_tokens: int) -> None:
    if slot_mapping.dtype != torch.int64 or tuple(slot_mapping.shape) != (num_tokens,):
        raise ValueError(f"slot_mapping must be int64 [T] = [{num_tokens}], got {slot_mapping.dtype} {tuple(slot_mapping.shape)}")


def _check_attention(q: torch.Tensor, meta: AttentionMetadata, block_size: int, head_dim: int) -> None:
    if q.dim() != 3 or q.shape[2] != head_dim:
        raise ValueError(f"q must be [T, Hq, D] with D = {head_dim} (the cache's), got {tuple(q.shape)}")
    if q.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"q dtype {q.dtype} is not a float type")
    if block_size != meta.block_size:
        raise ValueError(f"cache block_size {block_size} != meta.block_size {meta.block_size}")
    if q.shape[0] != meta.num_tokens:
        raise ValueError(f"q has {q.shape[0]} tokens but meta.slot_mapping has {meta.num_tokens}")
    if (meta.query_start_loc.shape[0] != meta.num_rows + 1 or meta.block_tables.dim() != 2
            or meta.block_tables.shape[0] != meta.num_rows):
        raise ValueError("meta.query_start_loc must be [R+1] and meta.block_tables [R, max_blocks]")


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                    return_lse: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Causal varlen GQA attention of q [T, Hq, D] over the paged caches [blocks, block_size, Hkv, D]
    -> out [T, Hq, D] (and lse [T, Hq] float32, natural log, +inf for no keys, when return_lse).
    Semantics: AttentionMetadata and pyengine/ops/reference/attention.py."""
    _check_kv_caches(k_cache, v_cache)
    _check_attention(q, meta, k_cache.shape[1], k_cache.shape[3])
    if q.shape[1] % k_cache.shape[2] != 0:
        raise ValueError(f"num_heads {q.shape[1]} is not a multiple of num_kv_heads {k_cache.shape[2]}")
    _check_same_device(q, k_cache, v_cache, meta.block_tables, meta.context_lens, meta.query_start_loc)
    return _impl(q.device, "paged_attention")(q, k_cache, v_cache, meta, scale, return_lse=return_lse)


def paged_attention_mla(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                        return_lse: bool = False, kv_lora_rank: int = KV_LORA_RANK
                        ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """MLA (absorbed) attention of q [T, Hq, W] over the latent cache [blocks, block_size, W]
    (W = kv_lora_rank + rope dims, DeepSeek-V3: 512 + 64; V = the first kv_lora_rank values of each
    row) -> out [T, Hq, kv_lora_rank] (and lse [T, Hq] when return_lse).
    Semantics: pyengine/ops/reference/mla.py."""
    _check_cache("kv_cache", kv_cache, dims=3)
    if not 0 < kv_lora_rank < kv_cache.shape[2]:
        raise ValueError(f"kv_lora_rank {kv_lora_rank} must be in (0, cache width {kv_cache.shape[2]})")
    _check_attention(q, meta, kv_cache.shape[1], kv_cache.shape[2])
    _check_same_device(q, kv_cache, meta.block_tables, meta.context_lens, meta.query_start_loc)
    return _impl(q.device, "paged_attention_mla")(q, kv_cache, meta, scale, return_lse=return_lse,
                                                   kv_lora_rank=kv_lora_rank)


def reshape_and_cache_mla(c_kv: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                          slot_mapping: torch.Tensor) -> None:
    """Write [c_kv [T, R] | k_pe [T, P]] of token t into kv_cache [blocks, block_size, R + P] at
    slot_mapping[t] (int64); slots < 0 are skipped (DeepSeek-V3: R = 512, P = 64)."""
    if c_kv.dim() != 2 or k_pe.dim() != 2 or c_kv.shape[0] != k_pe.shape[0]:
        raise ValueError(f"c_kv must be [T, R] and k_pe [T, P], got {tuple(c_kv.shape)} / {tuple(k_pe.shape)}")
    _check_cache("kv_cache", kv_cache, dims=3)
    if kv_cache.shape[2] != c_kv.shape[1] + k_pe.shape[1]:
        raise ValueError(f"kv_cache must be [blocks, block_size, {c_kv.shape[1] + k_pe.shape[1]}], got {tuple(kv_cache.shape)}")
    _check_slots(slot_mapping, c_kv.shape[0])
    _check_same_device(c_kv, k_pe, kv_cache, slot_mapping)
    _impl(c_kv.device, "reshape_and_cache_mla")(c_kv, k_pe, kv_cache, slot_mapping)


def _check_rows(name: str, x: torch.Tensor, width: int | None = None) -> None:
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"{name} must be [T, H] with a contiguous last dim, got {tuple(x.shape)}")
    if x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name} dtype {x.dtype} is not a float type")
    if width is not None and x.shape[1] != width:
        raise ValueError(f"{name} has width {x.shape[1]}, expected {width}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, H] -> x * rsqrt(mean(x^2) + eps) * weight, fp32 math (see reference/layer.py)."""
    _check_rows("x", x, weight.shape[0])
    _check_same_device(x, weight)
    return _impl(x.device, "rms_norm")(x, weight, eps)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """In place: residual <- x + residual, x <- rms_norm(residual); returns (x, residual)."""
    _check_rows("x", x, weight.shape[0])
    if residual.shape != x.shape or residual.dtype != x.dtype or not residual.is_contiguous() or not x.is_contiguous():
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} must match x {tuple(x.shape)} {x.dtype}, both contiguous")
    _check_same_device(x, residual, weight)
    return _impl(x.device, "fused_add_rms_norm")(x, residual, weight, eps)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] -> silu(x[:, :I]) * x[:, I:] as [T, I]."""
    _check_rows("x", x)
    if x.shape[1] % 2:
        raise ValueError(f"silu_and_mul needs an even width, got {x.shape[1]}")
    return _impl(x.device, "silu_and_mul")(x)


def rope_and_cache(qk: torch.Tensor, v: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Rotate q and k in place (qk [T, Hq + Hkv, D], rows may be strided; cos/sin [T, D], None = no
    rotation) and write k = qk[:, Hq:] and v [T, Hkv, D] to the paged caches at slot_mapping [T]
    (int64, -1: no write). The models' only KV-cache write."""
    _check_kv_caches(k_cache, v_cache)
    t, hkv, d = v.shape[0], k_cache.shape[2], k_cache.shape[3]
    if qk.dim() != 3 or qk.shape[0] != t or qk.shape[2] != d or qk.shape[1] <= hkv or qk.stride(-1) != 1:
        raise ValueError(f"qk must be [T, Hq + Hkv, D] with D = {d} contiguous, got {tuple(qk.shape)}")
    if tuple(v.shape) != (t, hkv, d) or v.stride(-1) != 1:
        raise ValueError(f"v must be [T, Hkv, D] = {(t, hkv, d)} with a contiguous last dim, got {tuple(v.shape)}")
    if (cos is None) != (sin is None) or (cos is not None and (tuple(cos.shape) != (t, d) or cos.shape != sin.shape)):
        raise ValueError(f"cos and sin must both be [T, D] = {(t, d)} or both None")
    _check_slots(slot_mapping, t)
    _check_same_device(qk, v, cos, sin, k_cache, v_cache, slot_mapping)
    _impl(qk.device, "rope_and_cache")(qk, v, cos, sin, k_cache, v_cache, slot_mapping)


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """x @ w (+ bias), w [in, out], by the backend's own GEMMs where it takes the call (CUDA:
    pyengine/ops/cuda/gemm.py: the skinny GEMM for one row, every size under
    KernelConfig.batch_invariant), else None: the caller runs torch's GEMM."""
    fn = getattr(_backend(x.device), "linear", None)
    return None if fn is None else fn(x, w, bias)


def grouped_linear(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor | None = None) -> torch.Tensor:
    """One [in, out] weight per group of rows, w [G, in, out] (MoE experts, attention heads):
      offs int32 [G] on x's device (cumulative row counts, torch._grouped_mm's offs): x [M, in] rows
        sorted by group, group g = rows [offs[g-1], offs[g]) -> [M, out]; rows past offs[-1] unwritten.
      offs None: x [T, G, in], group g = x[:, g] -> [T, G, out].
    A row's result is linear(row, w[g]) of that row alone, whatever the other groups hold: on CUDA
    (fp16/bf16, NVIDIA) the grouped invariant GEMM with no host synchronisation
    (pyengine/ops/cuda/gemm.py), elsewhere the groups one at a time through linear() (the
    reference; with offs it reads the counts on the host)."""
    if w.dim() != 3 or x.dim() != (2 if offs is not None else 3) or x.shape[-1] != w.shape[1]:
        raise ValueError(f"grouped_linear needs w [G, in, out] and x [M, in] with offs or [T, G, in] without, "
                         f"got {tuple(x.shape)} / {tuple(w.shape)}")
    if offs is None and x.shape[1] != w.shape[0]:
        raise ValueError(f"x [T, G, in] must have G = {w.shape[0]} groups, got {tuple(x.shape)}")
    if offs is not None and (offs.dtype != torch.int32 or tuple(offs.shape) != (w.shape[0],)):
        raise ValueError(f"offs must be int32 [{w.shape[0]}] (cumulative rows per group), got {offs.dtype} "
                         f"{tuple(offs.shape)}")
    if x.dtype not in _FLOAT_DTYPES or w.dtype != x.dtype:
        raise ValueError(f"grouped_linear takes floating x and w of one dtype, got {x.dtype} / {w.dtype}")
    _check_same_device(x, w, offs)
    fn = getattr(_backend(x.device), "grouped_linear", None)
    y = None if fn is None else fn(x, w, offs)
    return y if y is not None else _grouped_linear_by_group(x, w, offs)


def _grouped_linear_by_group(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor | None) -> torch.Tensor:
    """grouped_linear's reference: each group's rows through linear() (torch.mm where no backend
    GEMM takes them)."""
    def mm(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        y = linear(rows, weight)
        return torch.mm(rows, weight) if y is None else y

    if offs is None:
        return torch.stack([mm(x[:, g], w[g]) for g in range(w.shape[0])], dim=1)
    y = torch.empty(x.shape[0], w.shape[2], dtype=x.dtype, device=x.device)
    begin = 0
    for g, end in enumerate(offs.tolist()):
        end = min(max(end, begin), x.shape[0])
        if end > begin:
            y[begin:end] = mm(x[begin:end], w[g])
        begin = end
    return y


# ---- recurrent-state ops of Mamba2 layers (semantics: pyengine/ops/reference/ssm.py) --------------


def _check_conv(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, activation: str | None) -> None:
    if conv_state.dim() != 3 or x.dim() != 2 or x.shape[1] != conv_state.shape[2] or weight.shape[0] != x.shape[1]:
        raise ValueError(f"x [ntok, dim] / conv_state [slots, rows, dim] / weight [dim, W] mismatch: "
                         f"{tuple(x.shape)} {tuple(conv_state.shape)} {tuple(weight.shape)}")
    if activation not in ("silu", "swish", None, "identity"):
        raise ValueError(f"unsupported activation {activation!r}")
    _check_same_device(x, conv_state, weight)


def causal_conv1d_update(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         query_start_loc: torch.Tensor, state_idx: torch.Tensor, num_accepted: torch.Tensor,
                         activation: str | None = "silu") -> torch.Tensor:
    """Decode / verify rows, 1..1+k tokens each (see reference.causal_conv1d_update)."""
    _check_conv(x, conv_state, weight, activation)
    return _impl(x.device, "causal_conv1d_update")(x, conv_state, weight, bias, query_start_loc, state_idx,
                                                   num_accepted, activation)


def causal_conv1d_fn(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     query_start_loc: torch.Tensor, state_idx: torch.Tensor, num_accepted: torch.Tensor,
                     has_initial_state: torch.Tensor, activation: str | None = "silu") -> torch.Tensor:
    """Prefill rows of any length (see reference.causal_conv1d_fn)."""
    _check_conv(x, conv_state, weight, activation)
    return _impl(x.device, "causal_conv1d_fn")(x, conv_state, weight, bias, query_start_loc, state_idx, num_accepted,
                                               has_initial_state, activation)


def _check_scan(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                z: torch.Tensor | None) -> None:
    if state.dim() != 4 or x.dim() != 3 or dt.dim() != 2 or B.dim() != 3 or (z is not None and z.shape != x.shape):
        raise ValueError(f"state must be [slots, H, P, N], x and z [ntok, H, P], dt [ntok, H], B and C [ntok, G, N], "
                         f"got {tuple(state.shape)} {tuple(x.shape)} {tuple(dt.shape)} {tuple(B.shape)}")
    _, H, P, N = state.shape
    G = B.shape[1]
    if H % G or tuple(x.shape[1:]) != (H, P) or tuple(B.shape[1:]) != (G, N) or B.shape != C.shape \
            or tuple(dt.shape[1:]) != (H,):
        raise ValueError(f"shape mismatch: state {tuple(state.shape)} x {tuple(x.shape)} dt {tuple(dt.shape)} "
                         f"B {tuple(B.shape)} C {tuple(C.shape)}")
    _check_same_device(state, x, dt, B, C, z)


def selective_state_update(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                           C: torch.Tensor, D: torch.Tensor | None, z: torch.Tensor | None,
                           dt_bias: torch.Tensor | None, query_start_loc: torch.Tensor, state_idx: torch.Tensor,
                           num_accepted: torch.Tensor, dt_softplus: bool = True,
                           dt_limit: tuple[float, float] | None = None) -> torch.Tensor:
    """Mamba2 multi-token state update (see reference.selective_state_update)."""
    _check_scan(state, x, dt, B, C, z)
    return _impl(x.device, "selective_state_update")(state, x, dt, A, B, C, D, z, dt_bias, query_start_loc, state_idx,
                                                     num_accepted, dt_softplus, dt_limit)


def ssd_chunk_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                   D: torch.Tensor | None, z: torch.Tensor | None, dt_bias: torch.Tensor | None,
                   query_start_loc: torch.Tensor, state: torch.Tensor, state_idx: torch.Tensor,
                   num_accepted: torch.Tensor, has_initial_state: torch.Tensor, chunk_size: int = 64,
                   dt_softplus: bool = True, dt_limit: tuple[float, float] | None = None) -> torch.Tensor:
    """Prefill rows (varlen) of the same recurrence (see reference.ssd_chunk_scan)."""
    _check_scan(state, x, dt, B, C, z)
    if has_initial_state is not None and has_initial_state.shape[0] != state_idx.shape[0]:
        raise ValueError(f"has_initial_state has {has_initial_state.shape[0]} rows, state_idx {state_idx.shape[0]}")
    return _impl(x.device, "ssd_chunk_scan")(x, dt, A, B, C, D, z, dt_bias, query_start_loc, state, state_idx,
                                             num_accepted, has_initial_state, chunk_size, dt_softplus, dt_limit)


def _check_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      state: torch.Tensor) -> None:
    if q.dim() != 3 or q.shape != k.shape or v.dim() != 3 or state.dim() != 4:
        raise ValueError(f"q and k must be [ntok, H, K], v [ntok, HV, V], state [slots, HV, V, K], got "
                         f"{tuple(q.shape)} {tuple(k.shape)} {tuple(v.shape)} {tuple(state.shape)}")
    t, h, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    if v.shape[0] != t or hv % h or tuple(state.shape[1:]) != (hv, dv, dk):
        raise ValueError(f"shape mismatch: q {tuple(q.shape)} v {tuple(v.shape)} state {tuple(state.shape)}")
    if tuple(g.shape) != (t, hv) or tuple(beta.shape) != (t, hv) or state.dtype != torch.float32:
        raise ValueError(f"g and beta must be [ntok, HV] = {(t, hv)} and the state fp32, got {tuple(g.shape)} "
                         f"{tuple(beta.shape)} {state.dtype}")
    _check_records(state)
    _check_same_device(q, k, v, g, beta, state)


def _check_records(state: torch.Tensor) -> None:
    dv, dk = state.shape[-2], state.shape[-1]
    if not reference.gdn.records_fit(dk, dv):
        raise ValueError(f"Gated DeltaNet token records do not fit a [V, K] = {(dv, dk)} slot head "
                         f"(reference.gdn.records_fit)")


def gated_delta_rule_update(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                            state: torch.Tensor, query_start_loc: torch.Tensor, state_idx: torch.Tensor,
                            num_accepted: torch.Tensor) -> torch.Tensor:
    """Gated DeltaNet decode / verify rows, 1..1+k tokens each: the base state after token 0 to slot
    idx[n, 0], a record per later token to idx[n, t] (see reference.gated_delta_rule_update)."""
    _check_delta_rule(q, k, v, g, beta, state)
    return _impl(q.device, "gated_delta_rule_update")(q, k, v, g, beta, state, query_start_loc, state_idx,
                                                      num_accepted)


def gated_delta_rule_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                             query_start_loc: torch.Tensor, state: torch.Tensor, state_idx: torch.Tensor,
                             num_accepted: torch.Tensor, has_initial_state: torch.Tensor) -> torch.Tensor:
    """Gated DeltaNet prefill rows in chunked form, the final state to slot idx[n, 0] (see
    reference.gated_delta_rule_chunked)."""
    _check_delta_rule(q, k, v, g, beta, state)
    return _impl(q.device, "gated_delta_rule_chunked")(q, k, v, g, beta, query_start_loc, state, state_idx,
                                                       num_accepted, has_initial_state)


def gated_delta_rule_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                             query_start_loc: torch.Tensor, state: torch.Tensor, state_idx: torch.Tensor,
                             num_accepted: torch.Tensor, has_initial_state: torch.Tensor) -> torch.Tensor:
    """A model's Gated DeltaNet prefill rows (gated_delta_rule_chunked's arguments and result). On
    CUDA, while KernelConfig.gdn_chunked_prefill (off by default: slower than the recurrence kernel
    today) and not batch_invariant, the chunk-wise kernel (pyengine/ops/cuda/gdn_prefill.py): equal
    to the recurrence within fp32 rounding but not bit for bit, and its bits depend on where the
    prompt was cut into chunks. Under batch_invariant a token must get the same bits prefilled, re-prefilled after preemption, cut anywhere, or decoded,
    so it keeps gated_delta_rule_chunked (the decode kernel's recurrence on CUDA); so do the CPU and
    shapes the kernel does not take. The chunk-wise kernel starts from the base state idx[n, 0]
    alone (no records replayed): every prefill row must have num_accepted 1, which the scheduler
    guarantees (a prefill row follows admission, preemption or a prefill chunk; StateCache.prepare
    asserts it)."""
    _check_delta_rule(q, k, v, g, beta, state)
    config = get_kernel_config()
    if q.is_cuda and config.gdn_chunked_prefill and not config.batch_invariant and _load("cuda") is not None:
        from pyengine.ops.cuda import gdn_prefill

        if gdn_prefill.runs_kernel(q, state):
            return gdn_prefill.chunked_gated_delta_rule_prefill(q, k, v, g, beta, state, query_start_loc, state_idx,
                                                                has_initial_state)
    return _impl(q.device, "gated_delta_rule_chunked")(q, k, v, g, beta, query_start_loc, state, state_idx,
                                                       num_accepted, has_initial_state)


def gated_delta_rule_materialise(state: torch.Tensor, state_idx: torch.Tensor, num_accepted: torch.Tensor,
                                 dst: torch.Tensor) -> None:
    """state[dst[n]] = base idx[n, 0] replayed with records idx[n, 1..a-1]: the full state after token
    a - 1 of the step that wrote the slot row (see reference.gated_delta_rule_materialise)."""
    if state.dim() != 4 or state.dtype != torch.float32 or state_idx.dim() != 2 \
            or num_accepted.shape != (state_idx.shape[0],) or dst.shape != (state_idx.shape[0],):
        raise ValueError(f"state [slots, HV, V, K] fp32, state_idx [n, S], num_accepted and dst [n], got "
                         f"{tuple(state.shape)} {state.dtype} {tuple(state_idx.shape)} {tuple(num_accepted.shape)} "
                         f"{tuple(dst.shape)}")
    _check_records(state)
    _check_same_device(state, state_idx, num_accepted, dst)
    _impl(state.device, "gated_delta_rule_materialise")(state, state_idx, num_accepted, dst)


def copy_state(state: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """state[dst[i]] = state[src[i]] for every pair with neither slot PAD (any pool: SSM or conv)."""
    _impl(state.device, "copy_state")(state, src, dst)


def normalize_state(conv_state: torch.Tensor, ssm_state: torch.Tensor, state_idx: torch.Tensor,
                    num_accepted: torch.Tensor, width: int) -> None:
    """Move each row's valid state to offset 0 (afterwards num_accepted = 1 is right for every row)."""
    _check_same_device(conv_state, ssm_state)
    _impl(conv_state.device, "normalize_state")(conv_state, ssm_state, state_idx, num_accepted, width)
