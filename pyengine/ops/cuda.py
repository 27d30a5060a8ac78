"""CUDA paged KV-cache and layer ops: thin wrappers over the kernels of hipkernels/ (pyengine._C.kernels).

Same signatures and semantics as pyengine.ops.reference (GQA), pyengine.ops.mla_reference (MLA) and
pyengine.ops.layer_reference (rms_norm, fused_add_rms_norm, silu_and_mul, rope_and_cache).
The wrappers validate shapes, dtypes and devices (ValueError), make the few layouts the kernels need
(16-byte aligned rows with a contiguous last dim, int32 metadata), own the split-KV workspace, and
pass raw device pointers plus the current stream to the extension; the extension never sees torch.

The attention kernels take fp16/bf16 queries and caches, the layer ops fp16/bf16/fp32 (one dtype for
all tensors of a call); other dtypes run the PyTorch reference. meta.max_query_len and meta.max_context_len must be upper bounds of the rows' values.
"""
from __future__ import annotations

import math
import os

import torch

from pyengine.engine.attention_metadata import AttentionMetadata
from pyengine.ops import layer_reference

try:
    from pyengine import _C

    _K = _C.kernels if getattr(_C, "has_kernels", False) else None
except ImportError:  # extension not built
    _K = None

if _K is None:
    raise ImportError("pyengine._C was built without GPU kernels (PYENGINE_KERNELS=OFF or no nvcc)")

_DTYPE_CODE = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}
_CONST = _K.paged_attention_constants()
SPLIT_BLOCK: int = _CONST["split_block"]  # keys per split unit; process-wide (benchmarks sweep it)
MAX_SPLITS: int = _CONST["max_splits"]
SPLIT_MAX_QUERY_LEN: int = _CONST["split_max_query_len"]
MLA_KV_LORA_RANK = 512
MLA_ROPE_DIM = 64
_PLAN_KEY = "cuda_paged_attention"


def _stream(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream


def _check_cuda(*tensors: torch.Tensor) -> None:
    device = tensors[0].device
    if device.type != "cuda":
        raise ValueError(f"pyengine.ops.cuda needs CUDA tensors, got {device}")
    for t in tensors[1:]:
        if t.device != device:
            raise ValueError(f"all tensors must be on one device, got {device} and {t.device}")


def _aligned_rows(x: torch.Tensor) -> torch.Tensor:
    """x with a contiguous last dim, 16-byte aligned base and row strides (copies only if needed)."""
    vec = 16 // x.element_size()
    if x.stride(-1) == 1 and x.data_ptr() % 16 == 0 and all(s % vec == 0 for s in x.stride()[:-1]):
        return x
    return x.contiguous()


def _slots(slot_mapping: torch.Tensor, num_tokens: int) -> torch.Tensor:
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != num_tokens:
        raise ValueError(f"slot_mapping must be [T={num_tokens}], got {tuple(slot_mapping.shape)}")
    if slot_mapping.dtype != torch.int64:
        raise ValueError(f"slot_mapping must be int64, got {slot_mapping.dtype}")
    return slot_mapping.contiguous()


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write key/value [T, Hkv, D] of token t into slot slot_mapping[t] of k_cache/v_cache
    [num_blocks, block_size, Hkv, D]; slots < 0 are skipped."""
    _check_cuda(key, value, k_cache, v_cache, slot_mapping)
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError(f"k_cache/v_cache must be equal contiguous [blocks, block_size, Hkv, D], got {tuple(k_cache.shape)} / {tuple(v_cache.shape)}")
    if k_cache.dtype not in _DTYPE_CODE or v_cache.dtype != k_cache.dtype:
        from pyengine.ops import reference

        return reference.reshape_and_cache(key, value, k_cache, v_cache, slot_mapping)
    num_tokens = key.shape[0]
    expected = (num_tokens, k_cache.shape[2], k_cache.shape[3])
    if tuple(key.shape) != expected or tuple(value.shape) != expected:
        raise ValueError(f"key/value must be [T, Hkv, D] = {expected}, got {tuple(key.shape)} / {tuple(value.shape)}")
    slots = _slots(slot_mapping, num_tokens)
    if num_tokens == 0:
        return
    key = key.to(k_cache.dtype)
    value = value.to(k_cache.dtype)
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    with torch.cuda.device(key.device):
        _K.reshape_and_cache(
            key.data_ptr(), value.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(),
            num_tokens, k_cache.shape[2], k_cache.shape[3], key.stride(0), key.stride(1),
            value.stride(0), value.stride(1), k_cache.element_size(), _stream(key.device),
        )


def reshape_and_cache_mla(
    c_kv: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write [c_kv (512) | k_pe (64)] of token t into kv_cache [num_blocks, block_size, 576] at
    slot_mapping[t]; slots < 0 are skipped."""
    _check_cuda(c_kv, k_pe, kv_cache, slot_mapping)
    rank, rope = c_kv.shape[-1], k_pe.shape[-1]
    if c_kv.dim() != 2 or k_pe.dim() != 2 or c_kv.shape[0] != k_pe.shape[0]:
        raise ValueError(f"c_kv must be [T, 512] and k_pe [T, 64], got {tuple(c_kv.shape)} / {tuple(k_pe.shape)}")
    if kv_cache.dim() != 3 or kv_cache.shape[2] != rank + rope or not kv_cache.is_contiguous():
        raise ValueError(f"kv_cache must be contiguous [blocks, block_size, {rank + rope}], got {tuple(kv_cache.shape)}")
    if kv_cache.dtype not in _DTYPE_CODE:
        from pyengine.ops import mla_reference

        return mla_reference.reshape_and_cache_mla(c_kv, k_pe, kv_cache, slot_mapping)
    num_tokens = c_kv.shape[0]
    slots = _slots(slot_mapping, num_tokens)
    if num_tokens == 0:
        return
    c_kv = c_kv.to(kv_cache.dtype)
    k_pe = k_pe.to(kv_cache.dtype)
    if c_kv.stride(-1) != 1:
        c_kv = c_kv.contiguous()
    if k_pe.stride(-1) != 1:
        k_pe = k_pe.contiguous()
    with torch.cuda.device(c_kv.device):
        _K.reshape_and_cache_mla(
            c_kv.data_ptr(), k_pe.data_ptr(), kv_cache.data_ptr(), slots.data_ptr(), num_tokens, rank, rope,
            c_kv.stride(0), k_pe.stride(0), kv_cache.element_size(), _stream(c_kv.device),
        )


def max_splits_for(max_context_len: int) -> int:
    """Workspace split dimension for a step (the kernel's per-row rule never exceeds it)."""
    return max(1, min(MAX_SPLITS, math.ceil(max(max_context_len, 0) / SPLIT_BLOCK)))


def _plan(meta: AttentionMetadata, device: torch.device) -> dict:
    """int32 metadata on the device and each split row's first workspace token (memoised per step)."""
    plan = meta.cache.get(_PLAN_KEY)
    if plan is None:
        qsl = meta.query_start_loc.to(device=device, dtype=torch.int32).contiguous()
        q_lens = qsl[1:] - qsl[:-1]
        split_tokens = torch.where(q_lens <= SPLIT_MAX_QUERY_LEN, q_lens, torch.zeros_like(q_lens))
        ws_start = (torch.cumsum(split_tokens, 0, dtype=torch.int32) - split_tokens).contiguous()
        plan = {
            "qsl": qsl,
            "ctx": meta.context_lens.to(device=device, dtype=torch.int32).contiguous(),
            "tables": meta.block_tables.to(device=device, dtype=torch.int32).contiguous(),
            "ws_start": ws_start,
            "ws_tokens": min(meta.num_tokens, meta.num_rows * SPLIT_MAX_QUERY_LEN),
            "max_splits": max_splits_for(meta.max_context_len),
            "workspace": {},
        }
        meta.cache[_PLAN_KEY] = plan
    return plan


def _launch(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
    return_lse: bool, num_kv_heads: int, head_dim_v: int, mla: bool,
):
    num_tokens, num_heads, head_dim = q.shape
    out = torch.empty(num_tokens, num_heads, head_dim_v, dtype=q.dtype, device=q.device)
    lse = torch.empty(num_tokens, num_heads, dtype=torch.float32, device=q.device) if return_lse else None
    if num_tokens == 0 or meta.num_rows == 0:
        out.zero_()
        if lse is not None:
            lse.fill_(float("inf"))
        return (out, lse) if return_lse else out
    plan = _plan(meta, q.device)
    max_splits = plan["max_splits"]
    ws_key = (num_heads, head_dim_v)
    ws = plan["workspace"].get(ws_key)
    if ws is None:
        n = plan["ws_tokens"] * num_heads * max_splits if max_splits > 1 else 0
        ws = (torch.empty(max(n * head_dim_v, 1), dtype=torch.float32, device=q.device),
              torch.empty(max(n, 1), dtype=torch.float32, device=q.device))
        plan["workspace"][ws_key] = ws
    q = _aligned_rows(q)
    tables = plan["tables"]
    with torch.cuda.device(q.device):
        _K.paged_attention(
            q.data_ptr(), q.stride(0), q.stride(1), k_cache.data_ptr(), v_cache.data_ptr(),
            out.data_ptr(), out.stride(0), out.stride(1), lse.data_ptr() if lse is not None else 0,
            ws[0].data_ptr(), ws[1].data_ptr(), plan["ws_start"].data_ptr(), tables.data_ptr(),
            plan["qsl"].data_ptr(), plan["ctx"].data_ptr(), meta.num_rows, num_heads, num_kv_heads,
            head_dim, head_dim_v, meta.block_size, tables.shape[1], int(meta.max_query_len), max_splits,
            float(scale), _DTYPE_CODE[q.dtype], mla, _stream(q.device), SPLIT_BLOCK, PDL and not mla,
            _num_sms(q.device),
        )
    return (out, lse) if return_lse else out


def _check_meta(q: torch.Tensor, meta: AttentionMetadata, block_size: int) -> None:
    if block_size != meta.block_size:
        raise ValueError(f"cache block_size {block_size} != meta.block_size {meta.block_size}")
    if q.shape[0] != meta.num_tokens:
        raise ValueError(f"q has {q.shape[0]} tokens but meta.slot_mapping has {meta.num_tokens}")
    if meta.query_start_loc.shape[0] != meta.num_rows + 1 or meta.block_tables.dim() != 2 or meta.block_tables.shape[0] != meta.num_rows:
        raise ValueError("meta.query_start_loc must be [R+1] and meta.block_tables [R, max_blocks]")
    _check_cuda(q, meta.block_tables, meta.context_lens, meta.query_start_loc)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Varlen causal GQA attention of q [T, Hq, D] over k_cache/v_cache [blocks, block_size, Hkv, D]
    -> out [T, Hq, D] (and lse [T, Hq] float32 natural log when return_lse; +inf for no keys)."""
    _check_cuda(q, k_cache, v_cache)
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"q must be [T, Hq, D] and k_cache/v_cache equal [blocks, B, Hkv, D], got {tuple(q.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    if q.shape[2] != head_dim or q.shape[1] % num_kv_heads != 0:
        raise ValueError(f"q {tuple(q.shape)} does not match the cache's Hkv={num_kv_heads}, D={head_dim}")
    _check_meta(q, meta, k_cache.shape[1])
    if q.dtype not in (torch.float16, torch.bfloat16) or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype or head_dim not in (64, 128, 256):
        from pyengine.ops import reference

        return reference.paged_attention(q, k_cache, v_cache, meta, scale, return_lse=return_lse)
    return _launch(q, k_cache, v_cache, meta, scale, return_lse, num_kv_heads, head_dim, mla=False)


def paged_attention_mla(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """MLA (absorbed) attention of q [T, Hq, 576] over the latent cache [blocks, block_size, 576]
    (V = first 512 values of each row) -> out [T, Hq, 512] (and lse [T, Hq] when return_lse).
    Runs the tensor-core kernel of hipkernels/mla_attention.hip (mla=True in the launch below)."""
    _check_cuda(q, kv_cache)
    width = MLA_KV_LORA_RANK + MLA_ROPE_DIM
    if q.dim() != 3 or q.shape[2] != width or kv_cache.dim() != 3 or kv_cache.shape[2] != width:
        raise ValueError(f"q must be [T, Hq, {width}] and kv_cache [blocks, B, {width}], got {tuple(q.shape)} / {tuple(kv_cache.shape)}")
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be contiguous")
    _check_meta(q, meta, kv_cache.shape[1])
    if q.dtype not in (torch.float16, torch.bfloat16) or kv_cache.dtype != q.dtype:
        from pyengine.ops import mla_reference

        return mla_reference.paged_attention_mla(q, kv_cache, meta, scale, return_lse=return_lse)
    return _launch(q, kv_cache, kv_cache, meta, scale, return_lse, 1, MLA_KV_LORA_RANK, mla=True)


# ---- per-token layer ops (hipkernels/layer_ops.hip) ------------------------------------------------


def _rows(name: str, x: torch.Tensor, width: int | None = None) -> None:
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"{name} must be [T, H] with a contiguous last dim, got {tuple(x.shape)}")
    if width is not None and x.shape[1] != width:
        raise ValueError(f"{name} has width {x.shape[1]}, expected {width}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, H] -> x * rsqrt(mean(x^2) + eps) * weight, fp32 math, one rounding."""
    _check_cuda(x, weight)
    _rows("x", x, weight.shape[0] if weight.dim() == 1 else -1)
    if x.dtype not in _DTYPE_CODE or weight.dtype != x.dtype:
        return layer_reference.rms_norm(x, weight, eps)
    weight = weight.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    with torch.cuda.device(x.device):
        _K.rms_norm(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], x.stride(0),
                    out.stride(0), float(eps), _DTYPE_CODE[x.dtype], _stream(x.device))
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """In place: residual <- x + residual (rounded), x <- rms_norm(residual); returns (x, residual)."""
    _check_cuda(x, residual, weight)
    _rows("x", x, weight.shape[0] if weight.dim() == 1 else -1)
    _rows("residual", residual, x.shape[1])
    if residual.shape != x.shape:
        raise ValueError(f"residual {tuple(residual.shape)} must match x {tuple(x.shape)}")
    if x.dtype not in _DTYPE_CODE or residual.dtype != x.dtype or weight.dtype != x.dtype:
        return layer_reference.fused_add_rms_norm(x, residual, weight, eps)
    weight = weight.contiguous()
    with torch.cuda.device(x.device):
        _K.fused_add_rms_norm(x.data_ptr(), residual.data_ptr(), weight.data_ptr(), x.shape[0], x.shape[1],
                              x.stride(0), residual.stride(0), float(eps), _DTYPE_CODE[x.dtype], _stream(x.device))
    return x, residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] -> silu(x[:, :I]) * x[:, I:] as [T, I]."""
    _check_cuda(x)
    _rows("x", x)
    if x.shape[1] % 2:
        raise ValueError(f"silu_and_mul needs an even width, got {x.shape[1]}")
    if x.dtype not in _DTYPE_CODE:
        return layer_reference.silu_and_mul(x)
    inter = x.shape[1] // 2
    out = torch.empty(x.shape[0], inter, dtype=x.dtype, device=x.device)
    with torch.cuda.device(x.device):
        _K.silu_and_mul(x.data_ptr(), out.data_ptr(), x.shape[0], inter, x.stride(0), out.stride(0),
                        _DTYPE_CODE[x.dtype], _stream(x.device))
    return out


def rope_and_cache(qk: torch.Tensor, v: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """One kernel: rotate q and k in place (qk [T, Hq + Hkv, D], rows may be strided; cos/sin [T, D],
    None = no rotation), then write k = qk[:, Hq:] and v [T, Hkv, D] to the paged caches
    [num_blocks, block_size, Hkv, D] at slot_mapping [T] (-1: no write)."""
    _check_cuda(qk, v, k_cache, v_cache, slot_mapping)
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError(f"k_cache/v_cache must be equal contiguous [blocks, block_size, Hkv, D], got {tuple(k_cache.shape)} / {tuple(v_cache.shape)}")
    t, hkv, d = v.shape[0], k_cache.shape[2], k_cache.shape[3]
    if qk.dim() != 3 or qk.shape[0] != t or qk.shape[2] != d or qk.shape[1] <= hkv or qk.stride(-1) != 1:
        raise ValueError(f"qk must be [T, Hq + Hkv, D] with D = {d} contiguous, got {tuple(qk.shape)}")
    if tuple(v.shape) != (t, hkv, d) or v.stride(-1) != 1:
        raise ValueError(f"v must be [T, Hkv, D] = {(t, hkv, d)} with a contiguous last dim, got {tuple(v.shape)}")
    if (cos is None) != (sin is None):
        raise ValueError("cos and sin must both be given or both be None")
    dtypes = {qk.dtype, v.dtype, k_cache.dtype, v_cache.dtype}
    cos_ptr = sin_ptr = cos_stride = sin_stride = 0
    if cos is not None and sin is not None:
        if tuple(cos.shape) != (t, d) or tuple(sin.shape) != (t, d):
            raise ValueError(f"cos and sin must be [T, D] = {(t, d)}, got {tuple(cos.shape)} / {tuple(sin.shape)}")
        _check_cuda(qk, cos, sin)
        cos = cos if cos.stride(-1) == 1 else cos.contiguous()
        sin = sin if sin.stride(-1) == 1 else sin.contiguous()
        dtypes |= {cos.dtype, sin.dtype}
        cos_ptr, sin_ptr, cos_stride, sin_stride = cos.data_ptr(), sin.data_ptr(), cos.stride(0), sin.stride(0)
    slots = _slots(slot_mapping, t)
    if len(dtypes) != 1 or qk.dtype not in _DTYPE_CODE or (cos is not None and d % 2):
        return layer_reference.rope_and_cache(qk, v, cos, sin, k_cache, v_cache, slot_mapping)
    if t == 0:
        return
    with torch.cuda.device(qk.device):
        _K.rope_and_cache(
            qk.data_ptr(), v.data_ptr(), cos_ptr, sin_ptr, k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(),
            t, qk.shape[1] - hkv, hkv, d, qk.stride(0), qk.stride(1), v.stride(0), v.stride(1), cos_stride,
            sin_stride, _DTYPE_CODE[qk.dtype], _stream(qk.device),
        )


# ---- skinny GEMM for decode (hipkernels/skinny_gemm.hip) ------------------------------------------

# PYENGINE_SKINNY_GEMM=0 keeps every projection on cuBLAS (benchmarks compare the two in one build);
# PYENGINE_PDL=0 launches the skinny GEMM and the GQA attention kernel without programmatic dependent
# launch.
SKINNY_GEMM = os.environ.get("PYENGINE_SKINNY_GEMM", "1") != "0"
PDL = os.environ.get("PYENGINE_PDL", "1") != "0"
# Rows up to which skinny_linear takes a projection. H100 (results/skinny_gemm_h100.json,
# results/decode_8b_skinny_h100.json): at M = 1 the 8B decode step's graph is 0.22 ms faster than
# with cuBLAS (PDL hides each projection's ramp behind the norm or SwiGLU before it); at M = 2 the
# kernel alone breaks even with cuBLAS, at M >= 4 it loses (8 rows per block: 150 registers).
SKINNY_MAX_M = 1
_SKINNY_DTYPES = {torch.float16: 0, torch.bfloat16: 1}
_NUM_SMS: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    n = _NUM_SMS.get(index)
    if n is None:
        n = _NUM_SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return n


def skinny_gemm(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, *, split: int = 0,
                tile_n: int = 0, pdl: bool | None = None, prefetch: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ w [K, N] (+ bias [N]) -> [M, N] in x's dtype (fp16/bf16, fp32 accumulation, one
    rounding). w is llama.py's [in, out] weight, contiguous. Each output's summation order depends on
    (K, N, split, tile_n) only: a row's result is the same alone and in any batch. split (1, 2, 4, 8)
    and tile_n (64, 128): 0 takes the default for the shape; benchmarks sweep them. prefetch: a
    contiguous tensor (the weight a later GEMM reads) pulled into L2 once this one's work is done."""
    _check_cuda(x, w)
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[0]:
        raise ValueError(f"x must be [M, K] and w [K, N], got {tuple(x.shape)} / {tuple(w.shape)}")
    m, k, n = x.shape[0], x.shape[1], w.shape[1]
    if x.dtype not in _SKINNY_DTYPES or w.dtype != x.dtype:
        raise ValueError(f"skinny_gemm takes fp16/bf16 x and w of one dtype, got {x.dtype} / {w.dtype}")
    if not w.is_contiguous() or w.data_ptr() % 16 or k % 8 or n % 8:
        raise ValueError(f"w must be contiguous and 16-byte aligned with K, N multiples of 8, got {tuple(w.shape)}")
    bias_ptr = 0
    if bias is not None:
        _check_cuda(x, bias)
        if tuple(bias.shape) != (n,) or bias.dtype != x.dtype:
            raise ValueError(f"bias must be [{n}] {x.dtype}, got {tuple(bias.shape)} {bias.dtype}")
        bias = bias.contiguous()
        bias_ptr = bias.data_ptr()
    pf_ptr = pf_bytes = 0
    if prefetch is not None and prefetch.device == x.device and prefetch.is_contiguous() and prefetch.data_ptr() % 16 == 0:
        pf_ptr, pf_bytes = prefetch.data_ptr(), prefetch.numel() * prefetch.element_size() // 16 * 16
    x = _aligned_rows(x)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    with torch.cuda.device(x.device):
        _K.skinny_gemm(x.data_ptr(), w.data_ptr(), bias_ptr, y.data_ptr(), m, n, k, x.stride(0), y.stride(0),
                       _SKINNY_DTYPES[x.dtype], _num_sms(x.device), split, tile_n, PDL if pdl is None else pdl,
                       pf_ptr, pf_bytes, _stream(x.device))
    return y


def skinny_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """x @ w (+ bias) through skinny_gemm where it is the faster choice (few rows, fp16/bf16, the
    layout and alignment it takes), else None: the caller then runs cuBLAS. No L2 prefetch: pulling
    o_proj's weight in during qkv did not help on the H100 (8B batch 1, graph forward 5.90-5.93 ms
    with it, 5.89 without; results/decode_8b_prefetch_h100.json)."""
    if (not SKINNY_GEMM or x.dim() != 2 or x.shape[0] > SKINNY_MAX_M or x.dtype not in _SKINNY_DTYPES
            or w.dtype != x.dtype or w.dim() != 2 or not w.is_contiguous() or w.data_ptr() % 16
            or x.shape[1] != w.shape[0] or x.shape[1] % 8 or w.shape[1] % 8 or x.device != w.device
            or (bias is not None and bias.dtype != x.dtype)):
        return None
    return skinny_gemm(x, w, bias)
