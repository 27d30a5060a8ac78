"""Which LLMs run batch-invariant when nobody says (pyengine/engine/invariance.py): the CPU kernels
always, CUDA for fp16/bf16 Llama-family models at the kernels' widths; an explicit value wins, and
asking for the mode where it cannot hold is a ValueError naming why."""
from __future__ import annotations

from typing import Any

import pytest
import torch

from pyengine.config import ModelConfig
from pyengine.engine.invariance import cuda_invariant_by_default, resolve_batch_invariant
from pyengine.models.llama import LlamaForCausalLM
from pyengine.ops.kernel_config import KernelConfig

CUDA = torch.device("cuda")


def tiny_llama(dtype: torch.dtype, **overrides: Any) -> LlamaForCausalLM:
    cfg = {"architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 1, "num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": 64}
    cfg.update(overrides)
    return LlamaForCausalLM(ModelConfig.from_hf_dict(cfg), dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_llama_in_16_bits_is_invariant_by_default(dtype: torch.dtype) -> None:
    assert cuda_invariant_by_default(tiny_llama(dtype), dtype)
    assert resolve_batch_invariant(tiny_llama(dtype), CUDA, dtype, KernelConfig())


@pytest.mark.parametrize("dtype, overrides, why", [
    (torch.float32, {}, "fp32: attention would run the per-query reference"),
    (torch.bfloat16, {"head_dim": 32, "num_attention_heads": 2, "num_key_value_heads": 2}, "no kernel for head_dim 32"),
    (torch.bfloat16, {"vocab_size": 250}, "lm_head width not a multiple of 8"),
    (torch.bfloat16, {"intermediate_size": 100}, "MLP width not a multiple of 8"),
])
def test_cuda_default_is_off_where_the_fast_invariant_path_does_not_cover(dtype: torch.dtype, overrides: dict,
                                                                          why: str) -> None:
    assert not resolve_batch_invariant(tiny_llama(dtype, **overrides), CUDA, dtype, KernelConfig()), why


def test_other_families_stay_opt_in_on_cuda() -> None:
    class OtherFamily(LlamaForCausalLM):  # a subclass is another model (Mamba2 hybrids, DeepSeek-V3 are not Llama)
        pass

    model = OtherFamily(tiny_llama(torch.bfloat16).config, torch.bfloat16)
    assert not cuda_invariant_by_default(model, torch.bfloat16)


@pytest.mark.parametrize("asked", [True, False])
def test_an_explicit_value_wins(asked: bool) -> None:
    for device, dtype in [(CUDA, torch.float32), (CUDA, torch.bfloat16), (torch.device("cpu"), torch.float32)]:
        got = resolve_batch_invariant(tiny_llama(dtype), device, dtype, KernelConfig(batch_invariant=asked))
        assert got is asked


def test_kernel_config_refuses_a_non_bool() -> None:
    with pytest.raises(ValueError, match="batch_invariant must be a bool or None"):
        KernelConfig(batch_invariant="yes")  # type: ignore[arg-type]


def test_the_default_cpu_llm_runs_invariant_and_the_reference_ops_do_not(smollm2_path: str) -> None:
    from pyengine import LLM

    assert LLM(device="cpu", dtype="float32", num_kv_blocks=8).kernel_config.batch_invariant is True
    refs = LLM(device="cpu", dtype="float32", num_kv_blocks=8, kernel_config={"cpu_kernels": False})
    assert refs.kernel_config.batch_invariant is False
    with pytest.raises(ValueError, match="needs KernelConfig.cpu_kernels"):
        LLM(device="cpu", dtype="float32", num_kv_blocks=8, kernel_config={"cpu_kernels": False},
            batch_invariant=True)
