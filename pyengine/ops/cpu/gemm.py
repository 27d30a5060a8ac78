"""The CPU decode GEMM (csrc/cpu/cpu_gemm.h): an [in, out] weight packed once into the C++ layout."""
from __future__ import annotations

import numpy as np
import torch

from pyengine.loader.gguf_dequant import BLOCK, BLOCK_LAYOUTS, Q8_0
from pyengine.ops.cpu.extension import DTYPE_CODE, kernels, raise_error
from pyengine.ops.cpu.threads import pool_threads_for
from pyengine.ops.kernel_config import get_kernel_config

# csrc/cpu/cpu_gemm.h's GemmIsa values by name (PackedLinear.isa, KernelConfig.cpu_qdot_isa)
ISA_LEVELS = {"avx2": 2, "avx512": 3, "amx": 4}


def _isa_limit(isa: str | None) -> int:
    """The GemmIsa level a weight may run (`isa`: a name of ISA_LEVELS, None: any), at most AVX2
    under KernelConfig.cpu_avx2_kernels."""
    level = ISA_LEVELS[isa] if isa is not None else ISA_LEVELS["amx"]
    return min(level, ISA_LEVELS["avx2"]) if get_kernel_config().cpu_avx2_kernels else level


class PackedLinear:
    """An fp32 or bf16 [in, out] weight in the layout of the C++ decode GEMM (csrc/cpu/cpu_gemm.h):
    called as y = layer(x, bias), one row's result independent of the other rows: each output is
    one k-ordered fp32 FMA chain fixed by the packing, so a row's bits are the same for every M and
    every thread count. Threads: torch's count when packed, capped by the cores free then
    (pyengine.ops.cpu.threads); the pool runs them only inside ModelRunner.step_threads.

    Kernels (`isa`): AVX-512 where the CPU has avx512f/bw/vl (bf16: also avx512_bf16), else AVX2 +
    FMA (csrc/cpu/cpu_gemm_avx2.h, every format below; KernelConfig.cpu_avx2_kernels at packing
    time: those on any AVX2 + FMA CPU). The two families differ in the last bits; each is
    batch-invariant. Without either, supported() is False and models keep oneDNN or torch.

    compact: an fp32 weight whose values are block-quantised ones (a GGUF Q4_0/Q4_1/Q8_0 tensor
    dequantised on load) is stored as its 4- or 8-bit codes plus per-block scale and offset and
    rebuilt exactly in the kernel (csrc/cpu/cpu_gemm_affine.h): same results bit for bit, 5x fewer
    bytes streamed per step. `bits_per_weight` says which: 32 (dense), 4 or 8."""

    def __init__(self, weight: torch.Tensor, compact: bool = True) -> None:
        raise_error(self._unsupported(weight))
        w = weight.detach().contiguous()
        self.dtype = w.dtype
        self.in_features, self.out_features = w.shape
        self.packed = kernels.PackedWeight(w.data_ptr(), self.in_features, self.out_features, DTYPE_CODE[w.dtype],
                                           compact, _isa_limit(None))
        kernels.set_num_threads(pool_threads_for(torch.get_num_threads()))

    @classmethod
    def from_gguf(cls, ggml_type: int, rows: np.ndarray, in_features: int,
                  int8_dot: bool | None = None, int16_dot: bool | None = None,
                  isa: str | None = None) -> PackedLinear | None:
        """An fp32 [in_features, len(rows)] weight packed straight from GGUF Q4_0 / Q4_1 / Q8_0
        blocks: rows (uint64) holds the address of each output's first block (a row of the file's
        tensor, anywhere: fused and reordered matrices need no copy), valid during the call. Its
        weights are the dequantised values bit for bit (csrc/cpu/cpu_gguf_pack.h says why): the
        PackedLinear the constructor makes of them, without making them. None for another type or
        a non-finite scale (the caller then dequantises).

        With int8_dot (None: KernelConfig.cpu_int8_dot), where the CPU has AVX2 + F16C, it computes
        in llama.cpp's arithmetic instead (the `int8_dot` property: activations quantised per
        32-input block to int8, integer dot products; csrc/cpu/cpu_gemm_qdot.h, spec
        pyengine.ops.reference.quant_dot): other bits than the dequantised weights' fp32 products,
        the same for a row whatever the batch. Else with int16_dot (None: KernelConfig.cpu_int16_dot)
        the same panels and integer dots with each activation as two int16 limbs (the `int16_dot`
        property; csrc/cpu/cpu_gemm_qdot16.cpp, the spec with act_bits=32): the dequantised weights'
        products up to fp32 rounding, other bits, the same for a row whatever the batch. Those run
        on the best kernels the CPU has up to `isa` ("amx", "avx512" or "avx2"; None:
        KernelConfig.cpu_qdot_isa), all with the same bits (csrc/cpu/cpu_gemm_qdot16_avx512.cpp,
        cpu_gemm_qdot16_amx.cpp); the `isa` property says which. KernelConfig.cpu_avx2_kernels caps
        every path at AVX2, the exact one too."""
        if rows.dtype != np.uint64 or rows.ndim != 1 or not rows.flags.c_contiguous:
            raise ValueError(f"PackedLinear.from_gguf takes a contiguous uint64 array of row addresses, got {rows.dtype}")
        kernels.set_num_threads(pool_threads_for(torch.get_num_threads()))  # the pool packs too
        if int8_dot is None:
            int8_dot = get_kernel_config().cpu_int8_dot
        if int16_dot is None:
            int16_dot = get_kernel_config().cpu_int16_dot
        limit = _isa_limit(isa if isa is not None else get_kernel_config().cpu_qdot_isa)
        act_bits = 8 if int8_dot else 32 if int16_dot else 0
        packed = kernels.pack_gguf(ggml_type, rows.ctypes.data, in_features, rows.shape[0], False, act_bits, limit)
        if packed is None:
            return None
        self = cls.__new__(cls)
        self.dtype, self.in_features, self.out_features, self.packed = torch.float32, in_features, rows.shape[0], packed
        return self

    @classmethod
    def quantised_q8(cls, weight: torch.Tensor) -> PackedLinear | None:
        """An fp32 [in, out] weight rounded to GGUF Q8_0 (per output, blocks of 32 inputs: an fp16
        scale max|w| / 127 and int8 codes) and packed as from_gguf packs such blocks: ~4x fewer bytes
        streamed, the integer-dot kernels. Not the weight's own values: only for a module whose
        numerics change nothing but proposals (an EAGLE-3 head: its drafts are verified). None where
        from_gguf cannot take it (in_features not a multiple of 32, a non-finite value)."""
        w = weight.detach().to(torch.float32).t().contiguous().numpy()  # [out, in]: a GGUF row per output
        out_features, in_features = w.shape
        if in_features % BLOCK or not np.isfinite(w).all():
            return None
        runs = w.reshape(out_features, in_features // BLOCK, BLOCK)
        scale = (np.abs(runs).max(axis=2) / 127.0).astype(np.float16)
        inverse = np.divide(1.0, scale.astype(np.float32), out=np.zeros(scale.shape, np.float32), where=scale > 0)
        blocks = np.empty(runs.shape[:2], dtype=BLOCK_LAYOUTS[Q8_0])
        blocks["d"] = scale
        blocks["qs"] = np.clip(np.rint(runs * inverse[:, :, None]), -127, 127).astype(np.int8)
        rows = np.uint64(blocks.ctypes.data) + np.arange(out_features, dtype=np.uint64) * np.uint64(blocks.strides[0])
        return cls.from_gguf(Q8_0, rows, in_features)

    @property
    def bits_per_weight(self) -> int:
        return self.packed.format or torch.finfo(self.dtype).bits

    @property
    def int8_dot(self) -> bool:
        """Packed from GGUF codes for llama.cpp's arithmetic (int8 activations, integer dots:
        csrc/cpu/cpu_gemm_qdot.h, spec pyengine.ops.reference.quant_dot), not the fp32 products of
        the dequantised weights."""
        return bool(getattr(self.packed, "int8_dot", False))

    @property
    def int16_dot(self) -> bool:
        """Packed from GGUF codes for activations as two int16 limbs and integer dots
        (csrc/cpu/cpu_gemm_qdot16.cpp, spec pyengine.ops.reference.quant_dot with act_bits=32)."""
        return int(getattr(self.packed, "qdot_act_bits", 0)) == 32

    @property
    def isa(self) -> str:
        """The kernels this weight runs: "avx512" or "avx2"; "amx" (int16 limbs: AMX tiles from 4
        rows, AVX-512 VNNI for fewer)."""
        return {level: name for name, level in ISA_LEVELS.items()}[int(self.packed.isa)]

    @property
    def packed_bytes(self) -> int:
        return int(self.packed.packed_bytes)

    def columns(self, ids: torch.Tensor) -> torch.Tensor | None:
        """Columns ids of the weight as rows [len(ids), in_features] float32, read from the packed
        codes (csrc/cpu/cpu_gguf_pack.h packed_columns): 8-bit ones as s * q, 4-bit ones as the
        GEMM's fma(s, q, m). None for a dense format; IndexError for an id outside [0, out_features)."""
        if self.dtype != torch.float32 or self.bits_per_weight not in (4, 8):
            return None
        ids = (ids if ids.dtype == torch.int64 else ids.to(torch.int64)).contiguous()
        out = torch.empty(ids.numel(), self.in_features, dtype=torch.float32)
        if not self.packed.columns(ids.data_ptr(), ids.numel(), out.data_ptr()):
            raise IndexError(f"column ids must lie in [0, {self.out_features})")
        return out

    @staticmethod
    def _unsupported(weight: torch.Tensor) -> str:
        """Why this weight cannot be packed here (empty: it can); shape and CPU rules are C++'s."""
        if weight.dtype not in DTYPE_CODE or weight.dim() != 2 or weight.device.type != "cpu":
            return f"PackedLinear takes a 2-D fp32/bf16 CPU weight, got {weight.dtype} {tuple(weight.shape)} on {weight.device}"
        return kernels.check_packed_weight(weight.shape[0], weight.shape[1], DTYPE_CODE[weight.dtype])

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
