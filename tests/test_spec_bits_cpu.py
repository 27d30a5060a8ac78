"""Losslessness in the logits on the CPU (issue 18), through the checker (pyengine.check): greedy
speculative decoding gives every output token the bits plain decoding gives it - the logits, not
only the tokens - in fp32 and bf16, for ngram (k 1, 4, 8) and a draft model, at block sizes 1, 16
and 64, with prefix caching, under preemption (a KV pool too small for the batch), and on the
kernels of AVX2-only CPUs. Alone vs
batched is checked too: on the CPU every op is batch-invariant by construction (docs/architecture.md)."""
from __future__ import annotations

import pytest

from pyengine.check import check_losslessness
from tests.test_cpu_ops import AVX2_FMA_CPU, GEMM_CPU

pytestmark = pytest.mark.skipif(not GEMM_CPU, reason="CPU has neither AVX-512 nor AVX2 + FMA for the packed GEMM")

PROMPTS = [
    "one two three four five six seven eight nine ten " * 4,  # ngram drafts accepted from the start
    "Write a story about a dragon",
    "def fibonacci(n):\n    " * 3,
]


def assert_bit_identical(report, *comparisons: str) -> None:
    for name in comparisons:
        counts = report.counts(name)
        assert counts["identical"] == len(PROMPTS), f"{name}: {counts} ({report.failures()})"
    stats = report.runs["spec"]["stats"]
    assert stats["num_accepted_tokens"] > 0  # speculation really ran (else spec == plain trivially)


@pytest.mark.parametrize("dtype,k", [("float32", 4), ("bfloat16", 4), ("bfloat16", 1), ("float32", 8)])
def test_ngram_spec_logits_equal_plain(smollm2_path: str, dtype: str, k: int) -> None:
    spec = {"method": "ngram", "num_speculative_tokens": k, "adaptive_draft_length": False}
    report = check_losslessness(PROMPTS, model=smollm2_path, device="cpu", dtype=dtype, speculative_config=spec,
                                max_tokens=20, alone=k == 4, chat=False, batch_invariant=True)
    assert_bit_identical(report, *(["spec", "alone"] if k == 4 else ["spec"]))
    assert report.passed


def test_ngram_spec_logits_equal_plain_on_the_avx2_kernels(smollm2_path: str) -> None:
    """The kernels an AVX2 + FMA CPU without AVX-512 runs (KernelConfig.cpu_avx2_kernels: attention,
    the packed GEMMs), on this CPU: speculation and batching keep every logit's bits there too."""
    if not AVX2_FMA_CPU:
        pytest.skip("the AVX2 kernels need AVX2 and FMA")
    spec = {"method": "ngram", "num_speculative_tokens": 4, "adaptive_draft_length": False}
    report = check_losslessness(PROMPTS, model=smollm2_path, device="cpu", dtype="bfloat16", speculative_config=spec,
                                max_tokens=20, alone=True, chat=False, batch_invariant=True,
                                kernel_config={"cpu_avx2_kernels": True})
    assert_bit_identical(report, "spec", "alone")
    assert report.passed


@pytest.mark.parametrize("block_size", [1, 64])
def test_block_sizes_and_preemption(smollm2_path: str, block_size: int) -> None:
    """Block size 1: a pool of 80 tokens for requests of up to 65, 30 and 45 tokens, which preempt
    one another. Block size 64: two blocks, the requests' last blocks shared out as they grow."""
    spec = {"method": "ngram", "num_speculative_tokens": 4, "adaptive_draft_length": False}
    report = check_losslessness(PROMPTS, model=smollm2_path, device="cpu", dtype="bfloat16", speculative_config=spec,
                                max_tokens=24, alone=False, chat=False, batch_invariant=True, block_size=block_size,
                                num_kv_blocks=max(2, 80 // block_size))
    assert_bit_identical(report, "spec")
    if block_size == 1:
        assert report.runs["plain"]["stats"]["num_preemptions"] + report.runs["spec"]["stats"]["num_preemptions"] > 0


def test_draft_model_spec_logits_equal_plain(smollm2_path: str) -> None:
    spec = {"method": "draft_model", "model": smollm2_path, "num_speculative_tokens": 3}
    report = check_losslessness(PROMPTS, model=smollm2_path, device="cpu", dtype="bfloat16", speculative_config=spec,
                                max_tokens=16, alone=False, chat=False, batch_invariant=True)
    assert_bit_identical(report, "spec")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_hybrid_model_batch_invariant_through_the_checker(tmp_path, dtype: str) -> None:
    """A Bamba model (Mamba2 + attention layers): every linear on the packed GEMM, prefill as the
    decode recurrence (tests/test_hybrid_invariance_cpu.py): spec and alone are bit-identical."""
    from tests.test_bamba import make_bamba_checkpoint

    make_bamba_checkpoint(str(tmp_path))
    prompts = [[5, 9, 33, 2, 71, 14] * 5, [8, 8, 8, 8, 12, 40, 41], list(range(3, 40))]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "adaptive_draft_length": False}
    report = check_losslessness(prompts, model=str(tmp_path), device="cpu", dtype=dtype, speculative_config=spec,
                                max_tokens=16, alone=True, chat=False, batch_invariant=True, block_size=4)
    for name in ("spec", "alone"):
        assert report.counts(name)["identical"] == len(prompts), report.failures()


def test_batch_invariant_refuses_what_it_cannot_keep(smollm2_path: str, tmp_path) -> None:
    """A clear ValueError, not a silently non-invariant run: the PyTorch references (cpu_kernels off),
    for a Llama model and a recurrent-state one."""
    from pyengine import LLM
    from tests.test_mamba2 import make_mamba2_checkpoint

    with pytest.raises(ValueError, match="cpu_kernels"):
        LLM(smollm2_path, device="cpu", batch_invariant=True, kernel_config={"cpu_kernels": False})
    make_mamba2_checkpoint(str(tmp_path))
    with pytest.raises(ValueError, match="cpu_kernels"):
        LLM(str(tmp_path), device="cpu", batch_invariant=True, kernel_config={"cpu_kernels": False})
    assert LLM(str(tmp_path), device="cpu", batch_invariant=True).model.packed_lm_head is not None
    with pytest.raises(ValueError, match="batch_invariant must be a bool"):
        LLM(smollm2_path, device="cpu", batch_invariant="yes")
