"""Batch invariance end to end on the GPU (issue 18): with LLM(batch_invariant=True), SmolLM2 in
bf16 gives bit-identical logits - not only tokens - for every output position whether a request
runs alone or in a batch of 32 mixed prompts (chunked prefills beside it), with ngram or
draft-model speculation (k 1..8) or without, with or without CUDA graphs, at block sizes 1/16/64.
In fp32 too (the fp32 invariant GEMM, attention per query token): SmolLM2, and a tiny random Llama
whose head size (8) no attention kernel takes. Skips without CUDA."""
from __future__ import annotations

import gc
from collections.abc import Callable

import pytest
import torch

from pyengine import LLM, SamplingParams
from pyengine.ops.kernel_config import get_kernel_config, use_kernel_config
from tests.test_gpu_e2e import gguf  # noqa: F401  (the SmolLM2 GGUF fixture)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PROMPTS = [
    "Write a story about a dragon",
    "one two three four five six seven eight nine ten " * 6,
    "List the first ten prime numbers, separated by commas.",
    "Repeat after me three times: the quick brown fox jumps over the lazy dog.",
    "Explain what a hash table is in two sentences.",
    "def fibonacci(n):\n    " * 3,
]
LAST_STATS: dict = {}  # the stats of the last run()
LONG = "The history of the city is long and full of events. " * 70  # ~770 tokens: > 512 keys, chunked


def run(gguf: str, prompts: list[str], max_tokens: int = 48, setup: Callable[[LLM], None] | None = None,
        **kw) -> list[tuple[list[int], torch.Tensor]]:
    llm = LLM(model=gguf, device="cuda", dtype=kw.pop("dtype", "bfloat16"), batch_invariant=kw.pop("batch_invariant", True),
              num_kv_blocks=kw.pop("num_kv_blocks", 4096), max_model_len=2048,
              max_num_batched_tokens=kw.pop("max_num_batched_tokens", 512), **kw)
    llm.engine.cfg.record_logits = True
    if setup is not None:
        setup(llm)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    reqs = llm.run_requests([(p, llm.tokenizer.encode(p)) for p in prompts], [params] * len(prompts))
    out = [(r.output_token_ids, torch.stack(r.logits)) for r in reqs]
    LAST_STATS.clear()
    LAST_STATS.update(llm.stats())
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return out


def assert_identical(got, want, what: str) -> None:
    for i, ((gt, gl), (wt, wl)) in enumerate(zip(got, want)):
        assert gt == wt, f"{what}: row {i} tokens differ at {next(j for j, (a, b) in enumerate(zip(gt, wt)) if a != b)}"
        diff = (gl - wl).abs().max().item()
        assert torch.equal(gl, wl), f"{what}: row {i} logits differ (max {diff})"


@pytest.fixture(scope="module")
def plain(gguf):
    return run(gguf, PROMPTS)


@pytest.mark.parametrize("spec", [{"method": "ngram", "num_speculative_tokens": 4},
                                  {"method": "ngram", "num_speculative_tokens": 1},
                                  {"method": "ngram", "num_speculative_tokens": 8, "adaptive_draft_length": False}])
def test_spec_equals_plain_bits(gguf, plain, spec):
    assert_identical(run(gguf, PROMPTS, speculative_config=spec), plain, f"spec {spec}")


def test_draft_model_equals_plain_bits(gguf, plain):
    spec = {"method": "draft_model", "model": gguf, "num_speculative_tokens": 4}
    assert_identical(run(gguf, PROMPTS, speculative_config=spec), plain, "draft model")


def test_eager_equals_graphs(gguf, plain):
    assert_identical(run(gguf, PROMPTS, enforce_eager=True), plain, "eager")


def test_graphs_captured_outside_a_step(gguf, plain):
    """Every graph captured up front, by a caller whose kernel config is not the engine's:
    the captures still record the engine's (invariant) kernels, so the steps that replay them give
    the bits of lazily captured graphs. Before the runner pinned its config, these graphs ran
    cuBLAS and 15 of 48 Spec-Bench rows changed tokens at batch 16."""
    seen: list[bool] = []
    replayed: list = []  # the graph runner

    def capture_up_front(llm: LLM) -> None:
        g, model = llm.engine.runner.graph_runner, llm.engine.runner.model
        forward = model.forward

        def spy(*args, **kwargs):
            seen.append(bool(get_kernel_config().batch_invariant))
            return forward(*args, **kwargs)

        model.forward = spy
        with use_kernel_config(batch_invariant=False):
            assert g.capture_all() > 0
        del model.forward
        replayed.append(g)

    got = run(gguf, PROMPTS, setup=capture_up_front)
    assert seen and all(seen), "a capture ran under the caller's kernel config"
    assert replayed[0].num_mixed > 0, "no step replayed a prefill graph"
    assert_identical(got, plain, "prefill graphs captured up front")


@pytest.mark.parametrize("block_size", [1, 64])
def test_block_sizes(gguf, plain, block_size):
    assert_identical(run(gguf, PROMPTS, block_size=block_size, num_kv_blocks=4096 * 16 // block_size), plain,
                     f"block size {block_size}")


def test_alone_equals_in_a_batch_of_32(gguf):
    """Each request alone vs in a batch of 32 (a long prompt chunked beside decode and verify rows,
    varied lengths, prefix-cache hits from repeated prompts), with speculation in the batch."""
    batch = [LONG] + [PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)) for i in range(31)]
    together = run(gguf, batch, max_tokens=24, speculative_config={"method": "ngram", "num_speculative_tokens": 4},
                   max_num_batched_tokens=256)
    for i in (0, 1, 2, 9, 31):
        assert_identical(run(gguf, [batch[i]], max_tokens=24), [together[i]], f"row {i} alone")


def test_batch_of_64_under_preemption(gguf):
    """64 mixed prompts in a KV pool too small for all of them (preempted requests re-prefill their
    tokens beside other rows' decode and verify steps): every row's logits equal the same request
    run alone with a roomy pool."""
    batch = [PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)) + str(i) for i in range(64)]
    crowded = run(gguf, batch, max_tokens=32, num_kv_blocks=64, block_size=16, max_num_batched_tokens=256,
                  speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    assert LAST_STATS["num_preemptions"] > 0 and LAST_STATS["num_accepted_tokens"] > 0
    for i in (0, 7, 33, 63):
        assert_identical(run(gguf, [batch[i]], max_tokens=32), [crowded[i]], f"row {i} alone")


# ---- fp32 (hipkernels/gemm/invariant_gemm_f32.hip; attention: reference.paged_attention_per_query) ----


@pytest.fixture(scope="module")
def plain_fp32(gguf):
    return run(gguf, PROMPTS[:4], max_tokens=16, dtype="float32")


def test_fp32_spec_equals_plain_bits(gguf, plain_fp32):
    spec = {"method": "ngram", "num_speculative_tokens": 4, "adaptive_draft_length": False}
    assert_identical(run(gguf, PROMPTS[:4], max_tokens=16, dtype="float32", speculative_config=spec), plain_fp32,
                     "fp32 ngram k 4")
    assert LAST_STATS["num_accepted_tokens"] > 0, LAST_STATS


def test_fp32_alone_equals_batched(gguf, plain_fp32):
    for i in (0, 1, 3):
        assert_identical(run(gguf, [PROMPTS[i]], max_tokens=16, dtype="float32"), [plain_fp32[i]], f"fp32 row {i} alone")


def tiny_llama_runs(path: str, dtype: str) -> dict:
    """Greedy logits of 8 mixed prompts batched (block size 4, token budget 16: chunked prefills
    beside decode rows), each alone, and batched with ngram speculation (k 3)."""
    from tests.tiny_models import make_prompts

    prompts = make_prompts(8, seed=3)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    def generate(llm: LLM, groups: list[list[list[int]]]) -> list[tuple[list[int], torch.Tensor]]:
        llm.engine.cfg.record_logits = True
        reqs = [r for g in groups for r in llm.run_requests([(None, p) for p in g], [params] * len(g))]
        return [(r.output_token_ids, torch.stack(r.logits)) for r in reqs]

    ngram = {"method": "ngram", "num_speculative_tokens": 3, "adaptive_draft_length": False, "prompt_lookup_min": 1,
             "prompt_lookup_max": 3}
    out: dict = {}
    for name, kw in [("batched", {}), ("ngram", {"speculative_config": ngram})]:
        llm = LLM(model=path, device="cuda", dtype=dtype, batch_invariant=True, max_model_len=128, block_size=4,
                  max_num_batched_tokens=16, max_num_seqs=8, enable_prefix_caching=False, **kw)
        out[name] = generate(llm, [prompts])
        if name == "batched":
            out["alone"] = generate(llm, [[p] for p in prompts])
        out[name + "_stats"] = llm.stats()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    return out


def test_tiny_llama_fp32_without_attention_kernels(tmp_path):
    """head_dim 8: every attention call runs the per-query reference, every linear the fp32 GEMM
    (K 64 and 112: no shape constraint). bf16 would need K % 64 == 0 (the tensor-core GEMM)."""
    from tests.tiny_models import make_checkpoint

    make_checkpoint("llama_gqa_untied", str(tmp_path))
    runs = tiny_llama_runs(str(tmp_path), "float32")
    assert_identical(runs["alone"], runs["batched"], "tiny llama fp32 alone")
    assert runs["ngram_stats"]["num_accepted_tokens"] > 0, runs["ngram_stats"]
    assert_identical(runs["ngram"], runs["batched"], "tiny llama fp32 ngram k 3")
