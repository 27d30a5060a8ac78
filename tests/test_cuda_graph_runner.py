"""The CUDA-graph runner's padded static-buffer path, run eagerly on the CPU (a CPU device captures nothing):
bucketing, padding rows (slot -1, context 0, never sampled) and step eligibility give the same
greedy tokens as the plain eager runner, for decode (q = 1), uniform verify steps (q = 1 + k) and
ragged ones (rows with different draft counts, packed at the front of the bucket's token slots)."""
from __future__ import annotations

import types

import numpy as np
import pytest

from pyengine import SamplingParams
from pyengine.engine.cuda_graph_runner import CudaGraphRunner
from pyengine.engine.graph_capture import default_buckets
from tests.spec_harness import run
from tests.tiny_models import make_checkpoint
from tests.test_spec_decode import make_prompts


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tiny_llama_graphs"))
    make_checkpoint("llama_gqa_untied", path)
    return path


def test_buckets() -> None:
    assert default_buckets(256) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert default_buckets(5) == [1, 2, 4, 5]
    assert default_buckets(1) == [1]


def _attach(llm, max_q: int) -> CudaGraphRunner:
    r = llm.engine.runner
    g = CudaGraphRunner(r.model, r.kv_caches, r.block_size, r.device, llm.engine.cfg.max_num_seqs, max_q,
                        llm.engine.cfg.max_model_len + max_q + r.block_size,
                        state_cache=r.state_cache)
    r.graph_runner = g
    return g


def _generate(llm, prompts, max_tokens=20):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert all(o.error is None for o in outs)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("n", [1, 3, 5])
def test_padded_decode_equals_eager(tiny: str, n: int) -> None:
    prompts = make_prompts(n)
    plain, _, _, _ = run(tiny, prompts, max_tokens=20, max_num_seqs=8)
    _, _, _, llm = run(tiny, prompts[:1], max_tokens=1, max_num_seqs=8)
    g = _attach(llm, 1)
    assert _generate(llm, prompts) == plain
    assert g.num_eager > 0, "no step took the padded path"


@pytest.mark.parametrize("n", [1, 3])
def test_padded_verify_equals_plain(tiny: str, n: int) -> None:
    prompts = make_prompts(2 * n)[::2]  # the repeating-pattern prompts: prompt lookup finds drafts
    plain, _, _, _ = run(tiny, prompts, max_tokens=24, max_num_seqs=8)
    spec = {"method": "ngram", "adaptive_draft_length": False, "num_speculative_tokens": 3, "prompt_lookup_min": 1,
            "prompt_lookup_max": 3}
    _, _, _, llm = run(tiny, prompts[:1], max_tokens=1, spec=spec, max_num_seqs=8)
    g = _attach(llm, 4)
    seen = []
    orig = g.execute

    def spy(batch, key):
        seen.append(key)
        return orig(batch, key)

    g.execute = spy
    assert _generate(llm, prompts, 24) == plain
    assert any(q > 1 for _, q in seen), "no uniform verify step took the padded path"


def test_ragged_verify_steps_equal_plain(tiny: str) -> None:
    """Adaptive ngram: rows carry 0..k drafts in the same step; those steps replay the graph of the
    longest row (CPU: the same static-buffer path, eagerly) and give plain decoding's tokens."""
    prompts = make_prompts(6)
    plain, _, _, _ = run(tiny, prompts, max_tokens=24, max_num_seqs=8)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
            "adaptive_draft_length": False}
    _, _, _, llm = run(tiny, prompts[:1], max_tokens=1, spec=spec, max_num_seqs=8)
    g = _attach(llm, 4)
    ragged = []
    orig = g.execute

    def spy(batch, key):
        lens = np.diff(batch.query_start_loc)
        if len(set(lens.tolist())) > 1:
            ragged.append(key)
        return orig(batch, key)

    g.execute = spy
    assert _generate(llm, prompts, 24) == plain
    assert ragged, "no ragged verify step took the padded path"


def test_ineligible_steps() -> None:
    g = CudaGraphRunner(None, [], 16, __import__("torch").device("cpu"), 8, 4, 256)

    def batch(qlens, ctx, width=2, li=None):
        qsl = np.concatenate([[0], np.cumsum(qlens)]).astype(np.int32)
        n = int(qsl[-1])
        return types.SimpleNamespace(query_start_loc=qsl, context_lens=np.array(ctx, np.int32),
                                     logits_indices=np.arange(n) if li is None else np.array(li),
                                     block_tables=np.zeros((len(qlens), width), np.int32))

    assert g.bucket_for(batch([1, 1, 1], [5, 6, 7])) == (4, 1)
    assert g.bucket_for(batch([3, 3], [5, 6])) == (2, 3)
    assert g.bucket_for(batch([1, 3], [5, 6])) == (2, 3)         # ragged: the longest row's q
    assert g.bucket_for(batch([2, 0, 1], [5, 6, 7])) is None      # a row without tokens
    assert g.bucket_for(batch([5, 5], [9, 9])) is None          # q above the captured maximum
    assert g.bucket_for(batch([7], [7], li=[6])) is None        # prefill: only the last position
    assert g.bucket_for(batch([1] * 9, [3] * 9)) is None        # more rows than the largest bucket
    assert g.bucket_for(batch([1], [3], width=17)) is None      # table wider than the static one


@pytest.mark.parametrize("k", [0, 3])
def test_hybrid_padded_steps_equal_plain(tmp_path, k: int) -> None:
    """Mamba2: decode/verify steps through the static state buffers (PAD slots in the padding row
    of a 3-row step in bucket 4) give plain decoding's tokens; prefill steps never take the padded
    path. k = 3 drafts by script, so every row verifies k drafts with every acceptance count."""
    from tests.scripted_proposer import make_llm
    from tests.test_mamba2 import make_mamba2_checkpoint
    from tests.test_spec_decode import scripted

    make_mamba2_checkpoint(str(tmp_path))
    prompts = make_prompts(3)
    if k == 0:
        prompts.append([5])  # a one-token prompt: its prefill step has q = 1 too
    plain, _, _, _ = run(str(tmp_path), prompts, max_tokens=20, max_num_seqs=8)
    spec = None
    if k:
        reference = {i: (len(p), out) for i, (p, out) in enumerate(zip(prompts, plain))}
        spec = {"method": "scripted", "num_speculative_tokens": k, "script": scripted(reference, k, [0, 1, 2, 3])}
    llm = make_llm(str(tmp_path), spec, device="cpu", max_num_seqs=8)
    g = _attach(llm, 1 + k)
    seen = []
    orig = g.execute

    def spy(batch, key):
        rows = len(batch.context_lens)
        assert int(batch.num_decode_rows) == rows, "a prefill row took the padded path"
        seen.append((*key, rows))
        return orig(batch, key)

    g.execute = spy
    assert _generate(llm, prompts) == plain
    assert seen, "no step took the padded path"
    if k:
        assert any(q == 1 + k and b > rows for b, q, rows in seen), "no padded uniform verify step"
