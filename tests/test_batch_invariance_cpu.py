"""Batch invariance end to end on the CPU (issue 18: "a row's numbers never depend on the batch"):
the default model (SmolLM2-135M GGUF) in fp32 and bf16 gives the same greedy tokens and bit-identical
per-token logits for a short prompt run alone and run next to a ~430-token prompt (whose prefill
shares the short prompt's prefill step, then every decode step).

This holds where the linears run pyengine's packed GEMM (AVX-512 or AVX2 + FMA: rows independent,
k order fixed by the packing) and attention runs the C++ kernel for every step, long prefills
included. Before, on an AVX2 CPU the linears ran oneDNN / torch.mm (kernel choice by M) and steps
over 32768 query-key pairs ran SDPA: the logits differed by up to 8e-5 (fp32) and 0.63 (bf16)."""
from __future__ import annotations

import gc

import pytest
import torch

from pyengine import LLM, SamplingParams
from pyengine.ops import cpu as cpu_ops
from tests.test_cpu_ops import AVX2_FMA_CPU, GEMM_CPU

# Skipped by the CPU's flags, not by has_gemm(): on an x86-64-v3 machine this must run (and fail
# if the model fell back to oneDNN).
pytestmark = pytest.mark.skipif(not GEMM_CPU, reason="CPU has neither AVX-512 nor AVX2 + FMA for the packed GEMM")

LONG = "The history of the city is long and full of events. " * 36
SHORT = ["The capital of France is", "def fibonacci(n):"]


@pytest.fixture(scope="module", params=["float32", "bfloat16", "bfloat16-avx2-kernels"])
def llm(request, smollm2_path: str):
    """The last: attention and the linears on the AVX2 + FMA kernels (KernelConfig.cpu_avx2_kernels),
    which CPUs without AVX-512 run."""
    dtype, _, avx2 = request.param.partition("-")
    if avx2 and not AVX2_FMA_CPU:
        pytest.skip("the AVX2 kernels need AVX2 and FMA")
    engine = LLM(smollm2_path, device="cpu", dtype=dtype, enable_prefix_caching=False,
                 kernel_config={"cpu_avx2_kernels": bool(avx2)})
    engine.engine.cfg.record_logits = True
    assert not avx2 or engine.model.packed_lm_head.isa == "avx2"
    yield engine
    del engine
    gc.collect()


def test_prompt_alone_equals_next_to_a_long_prompt(llm: LLM) -> None:
    model = llm.model
    assert isinstance(model.packed_lm_head, cpu_ops.PackedLinear) and model.cpu_stack is not None
    tok = llm.tokenizer
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    short = [tok.encode(s) for s in SHORT]
    long = tok.encode(LONG)
    assert 380 <= len(long) <= 480  # its prefill alone: > 32768 query-key pairs per layer
    alone = [llm.run_requests([(None, ids)], [params])[0] for ids in short]
    mixed = llm.run_requests([(None, long)] + [(None, ids) for ids in short], [params] * 3)[1:]
    for i, (a, b) in enumerate(zip(alone, mixed)):
        assert a.output_token_ids == b.output_token_ids, f"prompt {i}: tokens differ"
        assert len(a.logits) == len(b.logits) == 10
        for t, (la, lb) in enumerate(zip(a.logits, b.logits)):
            assert torch.equal(la, lb), f"prompt {i} token {t}: logits differ by {(la - lb).abs().max().item()}"
