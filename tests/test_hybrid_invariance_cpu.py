"""Batch invariance of the recurrent-state (hybrid) models on the CPU: every committed token's logits
are bit-identical whatever step computed it. For Mamba2, Bamba, NemotronH and Qwen3-Next (fp32,
greedy) the reference is 8 prompts of 10..40 tokens run as one batch; each must give the same
tokens and the same logits bits when run alone, when the token budget (7) cuts every prefill into
chunks at odd positions (a token lands anywhere in a chunk of any length), with ngram speculation
(k = 3), and with scripted drafts that force every acceptance count 0..3 while prefill chunks share
the steps (verify rows next to prefill rows, rows without drafts right after an accepted run), and
when prefix caching restores a state checkpointed at a block boundary and prefills only the rest.

This holds because every projection runs pyengine's packed GEMM (rows independent), every torch
transcendental runs padded per row (layers.rowwise), and prefill runs the decode recurrence token
after token (ops/cpu/ssm.py, ops/cpu/gdn.py) instead of the chunked form, whose bits depend on where
the prompt was cut."""
from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest
import torch
import transformers

from pyengine import LLM, SamplingParams
from pyengine.check import share_loaded_models
from pyengine.ops import cpu as cpu_ops
from tests.hybrid_spec_checks import make_hybrid_checkpoint
from tests.scripted_proposer import make_llm
from tests.test_bamba import make_bamba_checkpoint
from tests.test_cpu_ops import GEMM_CPU
from tests.test_mamba2 import MAMBA2
from tests.test_nemotron_h import NEMOTRON_H
from tests.test_spec_decode import scripted
from tests.tiny_models import VOCAB, make_qwen3_next_checkpoint

pytestmark = pytest.mark.skipif(not GEMM_CPU, reason="CPU has neither AVX-512 nor AVX2 + FMA for the packed GEMM")

MAX_TOKENS = 14
# The tests' tiny checkpoints with SSM / delta-rule widths that are no multiples of 16 (head dims 9
# and 12, state size 9, Bamba's MLP 100): torch's elementwise kernels leave a scalar tail after whole
# SIMD chunks, so a tail that depends on the step shows up in the bits.
FAMILIES: dict[str, Callable[[str], Any]] = {
    "mamba2": lambda path: make_hybrid_checkpoint(
        path, transformers.Mamba2ForCausalLM, transformers.Mamba2Config(**dict(MAMBA2, hidden_size=36, head_dim=9,
                                                                             state_size=9)),
        0, ("out_proj.weight",), out_std=0.01),
    "bamba": lambda path: make_bamba_checkpoint(path, hidden_size=36, head_dim=16, mamba_d_head=9, mamba_d_state=9,
                                                intermediate_size=100),
    "nemotron_h": lambda path: make_hybrid_checkpoint(
        path, transformers.NemotronHForCausalLM, transformers.NemotronHConfig(**dict(NEMOTRON_H, mamba_head_dim=9,
                                                                                   ssm_state_size=9)),
        0, ("out_proj.weight", "o_proj.weight", "down_proj.weight"), out_std=0.02, dt_bias_mean=-3.0, dt_bias_std=2.0),
    # tied embeddings: the lm_head is the embedding table's packed transpose
    "qwen3_next": lambda path: make_qwen3_next_checkpoint(path, layer_scale=0.3, tie_word_embeddings=True,
                                                          linear_key_head_dim=12, linear_value_head_dim=9),
}
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "adaptive_draft_length": False, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}

Run = list[tuple[list[int], list[torch.Tensor]]]  # per request: output tokens, one logits row per token


def make_prompts() -> list[list[int]]:
    """8 prompts of 10..40 tokens; each repeats a short motif so prompt lookup finds drafts."""
    rng = random.Random(7)
    prompts = []
    for n in (10, 13, 17, 22, 26, 31, 35, 40):
        motif = [rng.randrange(3, VOCAB) for _ in range(rng.randint(3, 6))]
        body = [rng.randrange(3, VOCAB) for _ in range(n // 3)] + motif * n
        prompts.append(body[:n])
    return prompts


def generate(llm: LLM, prompts: list[list[int]], batched: bool = True) -> Run:
    """Greedy runs, all prompts in one batch or each alone; logits copied out of the step tensors."""
    llm.engine.cfg.record_logits = True
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    groups = [prompts] if batched else [[p] for p in prompts]
    out: Run = []
    for group in groups:
        for r in llm.run_requests([(None, p) for p in group], [params] * len(group)):
            assert r.error is None, r.error
            out.append((list(r.output_token_ids), [x.clone() for x in r.logits]))
    return out


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def runs(request, tmp_path_factory) -> dict[str, Any]:
    path = str(tmp_path_factory.mktemp(request.param))
    FAMILIES[request.param](path)
    prompts = make_prompts()
    common: dict[str, Any] = dict(device="cpu", dtype="float32", max_model_len=128, block_size=4,
                                  enable_prefix_caching=False)
    with share_loaded_models():
        batched = LLM(path, **common)
        chunked = LLM(path, **common, max_num_batched_tokens=7)
        ngram = LLM(path, **common, speculative_config=NGRAM)
        result = {"model": batched.model, "batched": generate(batched, prompts),
                  "alone": generate(batched, prompts, batched=False), "chunked": generate(chunked, prompts),
                  "ngram": generate(ngram, prompts), "ngram_stats": ngram.stats()}
        reference = {i: (len(p), out) for i, (p, (out, _)) in enumerate(zip(prompts, result["batched"]))}
        script = {"method": "scripted", "num_speculative_tokens": 3, "script": scripted(reference, 3, [3, 0, -1, 2, 1])}
        spec = make_llm(path, script, **common, max_num_batched_tokens=12)
        result.update(scripted=generate(spec, prompts), scripted_stats=spec.stats())
        # The second run restores each prompt's state checkpointed at its last full block (every
        # 4 tokens) and prefills only the rest.
        cached = LLM(path, **dict(common, enable_prefix_caching=True), state_checkpoint_interval=4)
        generate(cached, prompts)
        result.update(prefix_hits=generate(cached, prompts), prefix_stats=cached.stats())
    return result


def assert_identical(ref: Run, other: Run, what: str) -> None:
    assert len(ref) == len(other) == 8
    for i, ((ref_tokens, ref_logits), (tokens, logits)) in enumerate(zip(ref, other)):
        assert len(ref_logits) == len(logits) == MAX_TOKENS, f"{what}: prompt {i}: logits not recorded"
        for t, (a, b) in enumerate(zip(ref_logits, logits)):
            assert torch.equal(a, b), (f"{what}: prompt {i} output {t}: logits differ by up to "
                                       f"{(a - b).abs().max().item():.3g}")
        assert ref_tokens == tokens, f"{what}: prompt {i}: tokens differ"


def test_every_linear_runs_the_packed_gemm(runs) -> None:
    model = runs["model"]
    assert isinstance(model.packed_lm_head, cpu_ops.PackedLinear) and model.owns_cpu_threads
    dense = [name for name, p in model.named_parameters() if p.dim() >= 2
             and not name.endswith(("embed_tokens", "conv_weight"))]  # a lookup table, the depthwise conv taps
    assert not dense, f"linears left on torch's GEMM: {dense}"


def test_alone_equals_batched(runs) -> None:
    assert_identical(runs["batched"], runs["alone"], "alone")


def test_chunked_prefill_equals_batched(runs) -> None:
    assert_identical(runs["batched"], runs["chunked"], "max_num_batched_tokens=7")


def test_ngram_equals_plain(runs) -> None:
    stats = runs["ngram_stats"]
    assert stats["num_accepted_tokens"] > 0, stats  # verify rows really ran
    assert_identical(runs["batched"], runs["ngram"], "ngram k=3")


def test_scripted_acceptance_next_to_prefill_chunks_equals_plain(runs) -> None:
    """Every acceptance count 0..3 and rows without drafts, while prefill chunks share the steps."""
    stats = runs["scripted_stats"]
    assert stats["num_accepted_tokens"] > 0 and stats["num_draft_tokens"] > stats["num_accepted_tokens"], stats
    assert_identical(runs["batched"], runs["scripted"], "scripted k=3, max_num_batched_tokens=12")


def test_prefill_after_a_restored_checkpoint_equals_batched(runs) -> None:
    stats = runs["prefix_stats"]
    assert stats["prefix_cache_hit_tokens"] > 0, stats
    assert_identical(runs["batched"], runs["prefix_hits"], "prefix-cache hits (state checkpoints every 4 tokens)")
