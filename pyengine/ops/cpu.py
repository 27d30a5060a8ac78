"""CPU layer ops: thin wrappers over the C++ loops of pyengine._C.cpu (csrc/cpu/cpu_*.cpp).

Same signatures and semantics as pyengine.ops.reference / layer_reference, for fp32 and bf16
tensors; any other dtype, or a layout the loops do not take, runs the reference. The extension
gets raw data pointers, sizes and row strides (like the GPU kernels, it never sees torch).

paged_attention (head_dim a multiple of 16) reads K/V in place, which wins for decode and verify
steps (a few queries per row); a step with much more attention work than that (long prefills)
runs the reference, whose SDPA kernel uses every core. Its rows are split over the C++ pool only
while torch runs one thread: inside an engine step of a model that owns the CPU threads
(ModelRunner.step_threads). With torch's OpenMP workers active, pool workers would fight them for
the cores.
"""
from __future__ import annotations

import torch

from pyengine.engine.attention_metadata import AttentionMetadata
from pyengine.ops import layer_reference, reference

try:
    from pyengine import _C

    _K = _C.cpu
except (ImportError, AttributeError) as exc:  # extension not built, or built before these ops
    raise ImportError("pyengine._C has no CPU layer ops") from exc

_DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1}
_META_KEY = "cpu_paged_attention"
# Query-key pairs (summed over rows) above which a step's attention runs the reference instead:
# beyond this the multi-threaded SDPA kernel beats one thread (measured on SmolLM2 shapes).
MAX_QUERY_KEY_PAIRS = 1 << 15


def _raise(error: str) -> None:
    """The C++ ops report misuse as a message rather than an exception (csrc/cpu/cpu_ops.h says why)."""
    if error:
        raise ValueError(error)


def _heads_contiguous(x: torch.Tensor) -> bool:
    """[T, H, D] whose heads are contiguous inside a token row (rows may be strided)."""
    return x.stride(2) == 1 and x.stride(1) == x.shape[2]


def step_tables(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """int32 contiguous block tables, query starts and context lengths, and the step's number of
    query-key pairs; built once per step and shared by every layer."""
    tables = meta.cache.get(_META_KEY)
    if tables is None:
        qsl = meta.query_start_loc.to(torch.int32).contiguous()
        ctx = meta.context_lens.to(torch.int32).contiguous()
        bt = meta.block_tables.to(torch.int32).contiguous()
        pairs = int(((qsl[1:] - qsl[:-1]).to(torch.int64) * ctx.to(torch.int64)).sum())
        tables = (bt, qsl, ctx, pairs)
        meta.cache[_META_KEY] = tables
    return tables


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, return_lse: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    code = _DTYPE_CODE.get(q.dtype)
    bt, qsl, ctx, pairs = step_tables(meta)
    if (code is None or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype or pairs > MAX_QUERY_KEY_PAIRS
            or q.shape[0] == 0 or q.shape[2] % 16):
        return reference.paged_attention(q, k_cache, v_cache, meta, scale, return_lse=return_lse)
    if not _heads_contiguous(q):
        q = q.contiguous()
    num_tokens, num_heads, head_dim = q.shape
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype)
    lse = torch.empty(num_tokens, num_heads, dtype=torch.float32) if return_lse else None
    _raise(_K.paged_attention(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
                       0 if lse is None else lse.data_ptr(), bt.data_ptr(), bt.shape[1], qsl.data_ptr(),
                       ctx.data_ptr(), ctx.shape[0], num_heads, k_cache.shape[2], head_dim, k_cache.shape[1],
                       k_cache.shape[0], scale, code, torch.get_num_threads() == 1))
    return (out, lse) if lse is not None else out


def rope_and_cache(qk: torch.Tensor, v: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    code = _DTYPE_CODE.get(qk.dtype)
    if (code is None or not (k_cache.dtype == v_cache.dtype == v.dtype == qk.dtype)
            or not _heads_contiguous(qk) or not _heads_contiguous(v)):
        return layer_reference.rope_and_cache(qk, v, cos, sin, k_cache, v_cache, slot_mapping)
    if cos is not None and sin is not None:
        cos = cos.to(qk.dtype).contiguous()
        sin = sin.to(qk.dtype).contiguous()
    slots = slot_mapping.contiguous()
    _raise(_K.rope_and_cache(qk.data_ptr(), qk.stride(0), v.data_ptr(), v.stride(0),
                      0 if cos is None else cos.data_ptr(), 0 if sin is None else sin.data_ptr(),
                      k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(), k_cache.shape[0] * k_cache.shape[1], qk.shape[0],
                      qk.shape[1] - v.shape[1], v.shape[1], qk.shape[2], code, torch.get_num_threads() == 1))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    code = _DTYPE_CODE.get(x.dtype)
    if code is None or weight.dtype != x.dtype:
        return layer_reference.rms_norm(x, weight, eps)
    x, weight = x.contiguous(), weight.contiguous()
    out = torch.empty_like(x)
    _raise(_K.rms_norm(x.data_ptr(), 0, out.data_ptr(), weight.data_ptr(), x.shape[0], x.shape[1], eps, code))
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    code = _DTYPE_CODE.get(x.dtype)
    if code is None or weight.dtype != x.dtype:
        return layer_reference.fused_add_rms_norm(x, residual, weight, eps)
    weight = weight.contiguous()
    _raise(_K.rms_norm(x.data_ptr(), residual.data_ptr(), 0, weight.data_ptr(), x.shape[0], x.shape[1], eps, code))
    return x, residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    code = _DTYPE_CODE.get(x.dtype)
    if code is None:
        return layer_reference.silu_and_mul(x)
    x = x.contiguous()
    inter = x.shape[1] // 2
    out = torch.empty(x.shape[0], inter, dtype=x.dtype)
    _K.silu_and_mul(x.data_ptr(), out.data_ptr(), x.shape[0], inter, code, torch.get_num_threads() == 1)
    return out


class PackedLinear:
    """An fp32 or bf16 [in, out] weight in the layout of the C++ decode GEMM (csrc/cpu/cpu_gemm.h):
    called as y = layer(x, bias), one row's result independent of the other rows. Threads:
    torch's count when packed; the pool runs them only inside ModelRunner.step_threads.

    compact: an fp32 weight whose values are block-quantised ones (a GGUF Q4_0/Q4_1/Q8_0 tensor
    dequantised on load) is stored as its 4- or 8-bit codes plus per-block scale and offset and
    rebuilt exactly in the kernel (csrc/cpu/cpu_gemm_affine.h): same results bit for bit, 5x fewer
    bytes streamed per step. `bits_per_weight` says which: 32 (dense), 4 or 8."""

    def __init__(self, weight: torch.Tensor, compact: bool = True) -> None:
        _raise(self._unsupported(weight))
        w = weight.detach().contiguous()
        self.dtype = w.dtype
        self.in_features, self.out_features = w.shape
        self.packed = _K.PackedWeight(w.data_ptr(), self.in_features, self.out_features, _DTYPE_CODE[w.dtype],
                                      compact)
        _K.set_num_threads(torch.get_num_threads())

    @property
    def bits_per_weight(self) -> int:
        return self.packed.format or torch.finfo(self.dtype).bits

    @property
    def packed_bytes(self) -> int:
        return int(self.packed.packed_bytes)

    @staticmethod
    def _unsupported(weight: torch.Tensor) -> str:
        """Why this weight cannot be packed here (empty: it can); shape and CPU rules are C++'s."""
        if weight.dtype not in _DTYPE_CODE or weight.dim() != 2 or weight.device.type != "cpu":
            return f"PackedLinear takes a 2-D fp32/bf16 CPU weight, got {weight.dtype} {tuple(weight.shape)} on {weight.device}"
        return _K.check_packed_weight(weight.shape[0], weight.shape[1], _DTYPE_CODE[weight.dtype])

    @staticmethod
    def supported(weight: torch.Tensor) -> bool:
        return not PackedLinear._unsupported(weight)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.dtype != self.dtype or x.dim() != 2 or x.shape[1] != self.in_features:
            raise ValueError(f"PackedLinear needs {self.dtype} [M, {self.in_features}], got {x.dtype} {tuple(x.shape)}")
        if x.stride(1) != 1 or (self.dtype == torch.bfloat16 and x.stride(0) % 2):
            x = x.contiguous()
        if bias is not None:
            bias = bias.to(self.dtype).contiguous()
        y = torch.empty(x.shape[0], self.out_features, dtype=self.dtype)
        self.packed.matmul(x.data_ptr(), x.stride(0), x.shape[0], 0 if bias is None else bias.data_ptr(), y.data_ptr())
        return y
