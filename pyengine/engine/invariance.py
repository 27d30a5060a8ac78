"""When an LLM runs batch-invariant (KernelConfig.batch_invariant: a row's numbers never depend on
the rest of the step; docs/architecture.md, "Batch invariance").

`batch_invariant=None` (the default) lets the LLM decide after loading, and an explicit True or
False wins. The product's promise is that speculation never changes a token's bits, so the mode is
on wherever its paths are fast ones:
- CPU: on whenever the model's linears are on pyengine's packed GEMM and the C++ ops run; those
  kernels sum a row in an order fixed by the row, so the mode costs nothing there.
- CUDA: on for the Llama family (GQA attention) in fp16/bf16 at the widths pyengine's kernels
  take (head_dim 64/128/256, every projection width a multiple of 8): Llama-8B decode x1.03 /
  1.00 / 1.09 at batch 1 / 16 / 64, a 4k prefill x1.15 (benchmarks/results/
  batch_invariant_decode64_h100.json); SmolLM2 x0.94 / 1.06 / 1.09 and x1.15
  (batch_invariant_smollm2_gguf_after_h100.json). Off for fp32 (attention then runs a per-query reference,
  eagerly), for DeepSeek-V3 (MLA on fixed key ranges: as fast as the default up to 4k keys at batch 1-32,
  x1.22-1.30 at batch 64, where the default walks each row as one range, and x1.26-1.56 at batch
  8-32 on 16k-32k, benchmarks/results/mla_one_range_default_h100.json; the model not measured) and
  for the recurrent-state hybrids (prefill as the decode recurrence; not measured against the
  targets): opt-in there.
"""
from __future__ import annotations

from typing import Any

import torch

from pyengine.ops.kernel_config import KernelConfig

ATTENTION_HEAD_DIMS = (64, 128, 256)  # the GQA kernels' head sizes (pyengine/ops/cuda/attention.py)


def cpu_invariance_problem(model: Any, kernel_config: KernelConfig) -> str | None:
    """Why batch_invariant cannot hold on the CPU for this model, or None."""
    from pyengine.ops.cpu import PackedLinear

    if not kernel_config.cpu_kernels:
        return "batch_invariant on the CPU needs KernelConfig.cpu_kernels (the references are not batch-invariant)"
    if not isinstance(getattr(model, "packed_lm_head", None), PackedLinear):
        return ("batch_invariant on the CPU needs pyengine's packed GEMM (x86-64 with AVX2 + FMA or AVX-512) for "
                "this model's linears")
    return None


def cuda_invariant_by_default(model: Any, dtype: torch.dtype) -> bool:
    """Whether the measured-cheap invariant path covers this CUDA model (module docstring)."""
    from pyengine.models.llama import LlamaForCausalLM

    if type(model) is not LlamaForCausalLM or dtype not in (torch.float16, torch.bfloat16):
        return False
    c = model.config
    widths = (c.hidden_size, c.intermediate_size, c.num_attention_heads * c.head_dim,
              c.num_key_value_heads * c.head_dim, c.vocab_size)
    return c.head_dim in ATTENTION_HEAD_DIMS and all(w % 8 == 0 for w in widths)


def resolve_batch_invariant(model: Any, device: torch.device, dtype: torch.dtype,
                            kernel_config: KernelConfig) -> bool:
    """kernel_config.batch_invariant when set, else the default for this model, device and dtype."""
    if kernel_config.batch_invariant is not None:
        return kernel_config.batch_invariant
    if device.type == "cpu":
        return cpu_invariance_problem(model, kernel_config) is None
    if device.type == "cuda":
        return cuda_invariant_by_default(model, dtype)
    return False
