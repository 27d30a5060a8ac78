"""Batch invariance of the Mamba2-family hybrids on CUDA (LLM(batch_invariant=True)): for Mamba2,
Bamba and NemotronH tiny random models in fp32 (and Mamba2 in bf16), every committed token's logits are
bit-identical whether its request runs in a batch of 8, alone, with every prefill cut into chunks
of 7 tokens, or with ngram speculation (k 3), and - Mamba2, which has no attention layers - with
CUDA graphs and eagerly. The GPU version of tests/test_hybrid_invariance_cpu.py.

This holds because LLM runs HybridForCausalLM.prepack_for_cuda (the mixers' HF [out, in] in_proj /
out_proj and the lm_head onto pyengine's invariant GEMMs), the norms run pyengine's row kernel
(layers.rms_norm_rows, the mixer's gated group norm included), the state ops are per-row kernels
(hipkernels/ssm/ssm_state.hip: prefill is the recurrence token after token), and attention layers
whose head size no kernel takes run the per-query reference. Qwen3-Next stays refused. Skips
without CUDA."""
from __future__ import annotations

import gc
from typing import Any

import pytest
import torch

from pyengine import LLM
from pyengine.models.hybrid import HybridForCausalLM, InOutLinear
from pyengine.models.layers import Mamba2Mixer
from tests.test_hybrid_invariance_cpu import FAMILIES, NGRAM, Run, assert_identical, generate, make_prompts
from tests.test_mamba2 import make_mamba2_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# fp32: the CPU test's checkpoints (odd widths: the fp32 GEMM takes any shape). bf16: the tensor-core
# invariant GEMM needs K % 64 == 0 and N % 8 == 0, which test_mamba2's default checkpoint meets.
BUILDERS = dict(FAMILIES, mamba2_aligned=make_mamba2_checkpoint)
CASES = [("mamba2", "float32"), ("bamba", "float32"), ("nemotron_h", "float32"), ("mamba2_aligned", "bfloat16")]


def runs_on(llm: LLM, prompts: list[list[int]], batched: bool = True) -> Run:
    out = generate(llm, prompts, batched)
    return [(tokens, [x.cpu() for x in logits]) for tokens, logits in out]


def free(llm: LLM) -> None:
    del llm
    gc.collect()
    torch.cuda.empty_cache()


@pytest.fixture(scope="module", params=CASES, ids=[f"{f}-{d}" for f, d in CASES])
def runs(request, tmp_path_factory) -> dict[str, Any]:
    family, dtype = request.param
    path = str(tmp_path_factory.mktemp(family))
    BUILDERS[family](path)
    prompts = make_prompts()
    common: dict[str, Any] = dict(device="cuda", dtype=dtype, max_model_len=128, block_size=4, max_num_seqs=8,
                                  enable_prefix_caching=False, batch_invariant=True)
    result: dict[str, Any] = {"family": family}
    batched = LLM(path, **common)
    result.update(model=batched.model, batched=runs_on(batched, prompts), alone=runs_on(batched, prompts, False))
    free(batched)
    for name, kw in [("chunked", dict(max_num_batched_tokens=7)), ("ngram", dict(speculative_config=NGRAM)),
                     ("eager", dict(enforce_eager=True))]:
        llm = LLM(path, **common, **kw)
        result[name] = runs_on(llm, prompts)
        result[name + "_stats"] = llm.stats()
        free(llm)
    return result


def test_hf_projections_run_the_invariant_gemm(runs) -> None:
    """prepack_for_cuda ran: no mixer projection is a dense [out, in] tensor (F.linear) any more,
    and the lm_head is an [in, out] CUDA tensor."""
    model = runs["model"]
    assert isinstance(model, HybridForCausalLM)
    mixers = [m for m in model.modules() if isinstance(m, Mamba2Mixer)]
    assert mixers and all(isinstance(m.in_proj, InOutLinear) and isinstance(m.out_proj, InOutLinear) for m in mixers)
    head = model.packed_lm_head
    assert isinstance(head, torch.Tensor) and head.is_cuda and head.shape == (model.config.hidden_size,
                                                                             model.config.vocab_size)


def test_alone_equals_batched(runs) -> None:
    assert_identical(runs["batched"], runs["alone"], "alone")


def test_chunked_prefill_equals_batched(runs) -> None:
    assert_identical(runs["batched"], runs["chunked"], "max_num_batched_tokens=7")


def test_ngram_equals_plain(runs) -> None:
    assert runs["ngram_stats"]["num_accepted_tokens"] > 0, runs["ngram_stats"]  # verify rows really ran
    assert_identical(runs["batched"], runs["ngram"], "ngram k=3")


def test_eager_equals_graphs(runs) -> None:
    assert_identical(runs["batched"], runs["eager"], "enforce_eager")


def test_qwen3_next_is_still_refused(tmp_path) -> None:
    from tests.tiny_models import make_qwen3_next_checkpoint

    make_qwen3_next_checkpoint(str(tmp_path))
    with pytest.raises(ValueError, match="not available for this recurrent-state model"):
        LLM(str(tmp_path), device="cuda", dtype="bfloat16", batch_invariant=True, max_model_len=64)


@pytest.mark.parametrize("width", [4, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_token_prefill_chunk_equals_decode_row(width: int, dtype: torch.dtype) -> None:
    """The scheduler runs a prompt's one-token last chunk as a decode row (causal_conv1d_update):
    its output must be the bits causal_conv1d_fn gives that token in a longer chunk (the two
    kernels once differed in the FMA contraction and the silu, and chunked prefill changed logits)."""
    from pyengine import ops

    dev, dim, t = "cuda", 108, 9
    g = torch.Generator(device=dev).manual_seed(width)
    x = torch.randn(t + 1, dim, device=dev, generator=g).to(dtype)
    w = torch.randn(dim, width, device=dev, generator=g).to(dtype)
    b = torch.randn(dim, device=dev, generator=g).to(dtype)
    idx, acc = torch.zeros(1, 1, dtype=torch.int32, device=dev), torch.ones(1, dtype=torch.int32, device=dev)

    def qsl(n: int) -> torch.Tensor:
        return torch.tensor([0, n], dtype=torch.int32, device=dev)

    def pool() -> torch.Tensor:
        return torch.zeros(1, width - 1, dim, dtype=dtype, device=dev)

    no, yes = torch.tensor([False], device=dev), torch.tensor([True], device=dev)
    y_all = ops.causal_conv1d_fn(x, pool(), w, b, qsl(t + 1), idx, acc, no, "silu")
    state_fn = pool()
    ops.causal_conv1d_fn(x[:t].contiguous(), state_fn, w, b, qsl(t), idx, acc, no, "silu")
    state_update = state_fn.clone()
    y_fn = ops.causal_conv1d_fn(x[t:].contiguous(), state_fn, w, b, qsl(1), idx, acc, yes, "silu")
    y_update = ops.causal_conv1d_update(x[t:].contiguous(), state_update, w, b, qsl(1), idx, acc, "silu")
    assert torch.equal(y_fn, y_all[t:])
    assert torch.equal(y_update, y_fn), (y_update.float() - y_fn.float()).abs().max().item()
