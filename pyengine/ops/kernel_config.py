"""Which kernel variants the ops run: typed switches set from Python, never read from the
environment. The ops read the current KernelConfig at each call and pass the kernel-side fields
to the kernels as launch parameters; LLM(kernel_config=...) sets it for its steps, tests and
benchmarks use `use_kernel_config(...)` around the calls they compare."""
from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class KernelConfig:
    cpu_kernels: bool = True  # CPU: the C++ ops and packed GEMM; False keeps the PyTorch references
    cpu_layer_stack: bool = True  # CPU: a Llama model's decoder layers in one C++ call per step
    # CPU: GGUF Q4_0/Q4_1/Q8_0 linears packed from their codes compute in llama.cpp's arithmetic
    # (activations quantised to int8 per 32 inputs, integer dots: csrc/cpu/cpu_gemm_qdot.h), ~1.5x
    # faster decode and llama.cpp's answers. Off by default: the default model then answers the
    # README's first question as llama.cpp does, with nonsense, where the dequantised weights' fp32
    # products (the default, as HF computes them) answer it (docs/kernels/cpu.md)
    cpu_int8_dot: bool = False
    # CPU: those linears (cpu_int8_dot off) with each activation as two int16 limbs per 32-input
    # block and integer dots on the same packed codes (csrc/cpu/cpu_gemm_qdot16.cpp): the dequantised
    # weights' products up to fp32 rounding (top-1 100%, max logit diff 2e-4 on 3078 positions), a
    # row's bits the same in any batch. The default since its decode cleared issue 24's bar for one
    # (>= 1x llama.cpp's at 1 thread, >= 1.5x at 2: medians x1.81 / x1.66 over three runs, pooled
    # x1.88 / x1.58; the exact products x1.28-1.37 / x1.23-1.49); prompts run at 0.6-0.7x the exact
    # products' speed, still 1.6-2x llama.cpp's (docs/kernels/cpu.md). False: the exact products.
    cpu_int16_dot: bool = True
    # CPU: the best kernels the int16-limb linears may run where the CPU has them, all with the same
    # bits: "amx" (AMX-INT8 tile products from 4 rows, AVX-512 VNNI for fewer: csrc/cpu/
    # cpu_gemm_qdot16_amx.cpp), "avx512" (VNNI, one vpdpwssd per two products:
    # cpu_gemm_qdot16_avx512.cpp) or "avx2"; the lower ones for comparisons
    cpu_qdot_isa: str = "amx"
    # CPU: an EAGLE-3 head's linears rounded to GGUF Q8_0 and run on the integer-dot kernels
    # (PackedLinear.quantised_q8): its fp32 weights (39 MB for the shipped head, 0.4 of the default
    # model's bytes) were streamed per forward, one per catch-up and per chained draft. Drafts only:
    # the output is the target's whatever the head computes. False: the dense fp32 weights.
    cpu_q8_draft_head: bool = True
    skinny_gemm: bool = True  # CUDA: single-row projections on pyengine's skinny GEMM (False: cuBLAS)
    pdl: bool = True  # CUDA: programmatic dependent launch for the skinny GEMM and GQA attention
    gqa_fma: bool = False  # NVIDIA: the CUDA-core (FMA) GQA kernel instead of the tensor-core one
    gqa_pairs_per_block: int = 0  # GQA FMA kernel: query-head pairs per block, 0 = chosen per launch (else 1, 2, 4, 8)
    # x86-64: the CPU kernels an AVX2 + FMA CPU without AVX-512 runs, even where AVX-512 is present:
    # attention and the packed GEMM's dense and affine panels on their AVX2 kernels (another
    # arithmetic than the AVX-512 ones: other bits, as batch-invariant), the int16-limb panels capped
    # at AVX2 (the same bits). Tests cover x86-64-v3 CPUs with it on CI's AVX-512 machine.
    cpu_avx2_kernels: bool = False
    mla_small_tile: bool = False  # NVIDIA: the small MLA tile (the one AMD builds) instead of the fast one
    # CUDA graphs: verify steps whose rows carry different draft counts replay the graph of the
    # longest row (False: they run eagerly, as before; benchmarks compare the two)
    graph_ragged_verify: bool = True
    # CUDA: Gated DeltaNet prefill rows on the chunk-wise kernel (docs/kernels/gdn_prefill.md) outside
    # batch_invariant; False (and batch_invariant) runs the recurrence token after token, decode's bits.
    # Off by default: on an H100 the chunk-wise kernel (fp32 SIMT) runs at 0.76-0.89x the recurrence
    # kernel (benchmarks/results/gdn_prefill_h100.json), which stages a row's tokens in shared memory
    gdn_chunked_prefill: bool = False
    # Every op computes a row's result from that row alone, whatever shares the step (docs/
    # architecture.md, "Batch invariance"): CUDA projections of every size run one GEMM family.
    # None: the LLM decides after loading (pyengine/engine/invariance.py); ops read None as off.
    batch_invariant: bool | None = None

    def __post_init__(self) -> None:
        if self.batch_invariant is not None and not isinstance(self.batch_invariant, bool):
            raise ValueError(f"batch_invariant must be a bool or None, got {self.batch_invariant!r}")
        if self.cpu_qdot_isa not in ("amx", "avx512", "avx2"):
            raise ValueError(f"cpu_qdot_isa must be 'amx', 'avx512' or 'avx2', got {self.cpu_qdot_isa!r}")
        if self.gqa_pairs_per_block not in (0, 1, 2, 4, 8):
            raise ValueError(f"gqa_pairs_per_block must be 0 (auto), 1, 2, 4 or 8, got {self.gqa_pairs_per_block!r}")

    @classmethod
    def from_value(cls, value: "KernelConfig | dict[str, Any] | None") -> "KernelConfig":
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"kernel_config must be a KernelConfig or a dict, got {type(value).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(value) - known
        if unknown:
            raise ValueError(f"kernel_config: unknown keys {sorted(unknown)} (known: {sorted(known)})")
        return cls(**value)


_current = KernelConfig()


def get_kernel_config() -> KernelConfig:
    return _current


def set_kernel_config(config: KernelConfig) -> None:
    global _current
    _current = config


@contextlib.contextmanager
def use_kernel_config(config: KernelConfig | None = None, **overrides: Any) -> Iterator[KernelConfig]:
    """Run a block under `config` (default: the current one) with `overrides` applied."""
    global _current
    saved = _current
    _current = dataclasses.replace(config or saved, **overrides) if overrides else config or saved  # frozen: no copy needed
    try:
        yield _current
    finally:
        _current = saved
