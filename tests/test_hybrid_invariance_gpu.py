"""Batch invariance of the recurrent-state hybrids on CUDA (LLM(batch_invariant=True)): for Mamba2,
Bamba, NemotronH and Qwen3-Next tiny random models in fp32 (and Mamba2 and Qwen3-Next in bf16),
every committed token's logits are bit-identical whether its request runs in a batch of 8, alone,
with every prefill cut into chunks of 7 tokens, or with ngram speculation (k 3); for Qwen3-Next also
with its MTP layer (k 3); and - Mamba2 (no attention layers) and bf16 Qwen3-Next (GQA kernel, head
dim 256, grouped MoE) - with CUDA graphs and eagerly. The GPU version of
tests/test_hybrid_invariance_cpu.py.

This holds because LLM runs the model's prepack_for_cuda (the Mamba2 mixers' HF [out, in] in_proj /
out_proj and the lm_head onto pyengine's invariant GEMMs; Qwen3-Next's [in, out] projections
checked, a tied lm_head copied), the norms run pyengine's row kernel (layers.rms_norm_rows, the
mixer's gated group norm, Qwen3-Next's q/k and gated norms included), the state ops are per-row
kernels whose prefill is the recurrence token after token (hipkernels/ssm/ssm_state.hip,
gated_delta_rule.hip: the chunk-wise GDN prefill is not used under batch_invariant), the MoE runs
the grouped invariant GEMM, and attention layers whose dtype or head size no kernel takes run the
per-query reference. Skips without CUDA."""
from __future__ import annotations

import gc
from typing import Any

import pytest
import torch

from pyengine import LLM
from pyengine.models.hybrid import HybridForCausalLM, InOutLinear
from pyengine.models.layers import Mamba2Mixer
from pyengine.models.qwen3_next import Qwen3NextForCausalLM, invariant_gemm_misfits
from tests.test_hybrid_invariance_cpu import FAMILIES, NGRAM, Run, assert_identical, generate, make_prompts
from tests.test_mamba2 import make_mamba2_checkpoint
from tests.tiny_models import make_qwen3_next_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# Qwen3-Next in bf16 at widths the tensor-core invariant GEMM takes (K % 64, N % 8: hidden 64, value
# heads 4 x 32, key heads 2 x 32, experts and shared expert 64 wide), attention at Qwen3-Next's head
# dim 256 (the GQA kernel), untied lm_head; an MTP layer (mtp.*) for the MTP run. Output projections
# at 0.03 (greedy runs fall into loops: on the CPU in fp32 ngram accepts 13 drafts, MTP 37).
QWEN3_NEXT_ALIGNED = dict(head_dim=256, linear_key_head_dim=32, linear_value_head_dim=32, moe_intermediate_size=64,
                          shared_expert_intermediate_size=64, intermediate_size=128)
# fp32: the CPU test's checkpoints (odd widths: the fp32 GEMM takes any shape). bf16: the tensor-core
# invariant GEMM needs K % 64 == 0 and N % 8 == 0, which test_mamba2's default checkpoint meets.
BUILDERS = dict(
    FAMILIES, mamba2_aligned=make_mamba2_checkpoint,
    qwen3_next=lambda path: make_qwen3_next_checkpoint(path, layer_scale=0.3, tie_word_embeddings=True,
                                                       linear_key_head_dim=12, linear_value_head_dim=9,
                                                       mtp_agreement=0.01),
    qwen3_next_aligned=lambda path: make_qwen3_next_checkpoint(path, layer_scale=0.03, mtp_agreement=0.01,
                                                               **QWEN3_NEXT_ALIGNED))
CASES = [("mamba2", "float32"), ("bamba", "float32"), ("nemotron_h", "float32"), ("mamba2_aligned", "bfloat16"),
         ("qwen3_next", "float32"), ("qwen3_next_aligned", "bfloat16")]
MTP = {"method": "mtp", "num_speculative_tokens": 3, "adaptive_draft_length": False}


def runs_on(llm: LLM, prompts: list[list[int]], batched: bool = True) -> Run:
    out = generate(llm, prompts, batched)
    return [(tokens, [x.cpu() for x in logits]) for tokens, logits in out]


def graph_replays(llm: LLM) -> int:
    return getattr(getattr(llm.engine.runner, "graph_runner", None), "num_replays", 0)


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
    result.update(model=batched.model, batched=runs_on(batched, prompts), batched_graph_replays=graph_replays(batched),
                  alone=runs_on(batched, prompts, False))
    free(batched)
    variants = [("chunked", dict(max_num_batched_tokens=7)), ("ngram", dict(speculative_config=NGRAM)),
                ("eager", dict(enforce_eager=True))]
    if family.startswith("qwen3_next"):
        variants.append(("mtp", dict(speculative_config=MTP)))
    for name, kw in variants:
        llm = LLM(path, **common, **kw)
        result[name] = runs_on(llm, prompts)
        result[name + "_stats"] = llm.stats()
        result[name + "_graph_replays"] = graph_replays(llm)
        free(llm)
    return result


def test_hf_projections_run_the_invariant_gemm(runs) -> None:
    """prepack_for_cuda ran: no mixer projection is a dense [out, in] tensor (F.linear) any more
    (Qwen3-Next: every projection an [in, out] weight the invariant GEMM takes), and the lm_head is
    an [in, out] CUDA tensor."""
    model = runs["model"]
    if isinstance(model, Qwen3NextForCausalLM):
        assert invariant_gemm_misfits(model, None) == []
        assert model.packed_lm_head.is_contiguous()
    else:
        assert isinstance(model, HybridForCausalLM)
        mixers = [m for m in model.modules() if isinstance(m, Mamba2Mixer)]
        assert mixers and all(isinstance(m.in_proj, InOutLinear) and isinstance(m.out_proj, InOutLinear)
                              for m in mixers)
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
    if runs["family"] == "qwen3_next_aligned":  # the graphed runs really replayed graphs
        assert runs["batched_graph_replays"] > 0 and runs["ngram_graph_replays"] > 0 and runs["mtp_graph_replays"] > 0
        assert runs["eager_graph_replays"] == 0
    assert_identical(runs["batched"], runs["eager"], "enforce_eager")


def test_mtp_equals_plain(runs) -> None:
    if not runs["family"].startswith("qwen3_next"):
        pytest.skip("no MTP layer")
    assert runs["mtp_stats"]["num_accepted_tokens"] > 0, runs["mtp_stats"]  # verify rows really ran
    assert_identical(runs["batched"], runs["mtp"], "mtp k=3")


def test_qwen3_next_widths_the_invariant_gemm_does_not_take_are_refused(tmp_path) -> None:
    """bf16 at the default tiny widths (value heads 24 wide: out_proj K = 96; experts 32 wide) is
    refused at load, naming the projections; the same checkpoint loads in fp32 (any width)."""
    make_qwen3_next_checkpoint(str(tmp_path))
    common: dict[str, Any] = dict(device="cuda", batch_invariant=True, max_model_len=64)
    with pytest.raises(ValueError, match=r"invariant GEMM, which does not take .*out_proj.*w_down"):
        LLM(str(tmp_path), dtype="bfloat16", **common)
    free(LLM(str(tmp_path), dtype="float32", **common))


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
