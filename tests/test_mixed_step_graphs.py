"""Steps with prefill rows on graphs (one prefill-graph replay per step, pyengine/engine/
prefill_graphs.py), run on the CPU through the runner's static-buffer path: decode/verify rows and
prefill rows share the graph, which computes the logits of the staged tokens only. Tokens must equal
the eager runner's through staggered admissions (prefill rows beside decode and verify rows),
chunked prefill (chunks that want no logits), prefill-only steps and speculation."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pyengine import LLM, SamplingParams
from pyengine.engine.cuda_graph_runner import CudaGraphRunner
from pyengine.engine.graph_capture import default_token_buckets, graph_shape
from tests.test_spec_decode import make_prompts
from tests.tiny_models import make_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tiny_llama_mixed"))
    make_checkpoint("llama_gqa_untied", path)
    return path


def make_llm(tiny: str, graphs: bool, spec: dict | None = None, prefill_tokens: int = 256, **kw) -> LLM:
    llm = LLM(model=tiny, device="cpu", speculative_config=spec, **kw)
    if graphs:
        r = llm.engine.runner
        max_q = 1 + (spec["num_speculative_tokens"] if spec else 0)
        r.graph_runner = CudaGraphRunner(r.model, r.kv_caches, r.block_size, r.device, llm.engine.cfg.max_num_seqs,
                                         max_q, llm.engine.cfg.max_model_len + max_q + r.block_size,
                                         prefill_tokens=prefill_tokens)
    return llm


def staggered(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    """Ragged max_tokens: requests finish at different steps and the waiting ones are admitted
    beside running decode rows (max_num_seqs below the number of prompts)."""
    params = [SamplingParams(temperature=0, max_tokens=6 + 5 * (i % 4), ignore_eos=True) for i in range(len(prompts))]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert all(o.error is None for o in outs)
    return [o.outputs[0].token_ids for o in outs]


def spy_keys(g: CudaGraphRunner, batches: list | None = None) -> list[tuple[int, int]]:
    """The graph keys the runner stages (CPU: no graph is captured, the same buffers run eagerly),
    and each step's batch into `batches` if given."""
    keys: list[tuple[int, int]] = []
    orig = g.execute

    def spy(batch, key, *patch):
        keys.append(key)
        if batches is not None:
            batches.append((key, int(batch.num_decode_rows), int(np.asarray(batch.num_draft_tokens).sum()),
                            int((np.asarray(batch.num_logits)[batch.num_decode_rows:] == 0).sum())))
        return orig(batch, key, *patch)

    g.execute = spy
    return keys


def test_token_buckets_and_shapes() -> None:
    assert default_token_buckets(100) == [16, 32, 64]
    assert default_token_buckets(8) == []
    assert graph_shape((4, 3)) == (4, 3, 12, False)
    assert graph_shape((2, -64)) == (2, 64, 64, True)
    g = CudaGraphRunner(None, [], 16, torch.device("cpu"), 32, 5, 256, prefill_tokens=64)
    assert g.prefill_keys() == [(b, -t) for b in (1, 2, 4, 8, 16, 32) for t in (16, 32, 64) if b <= t]
    assert g.logits_slots((32, -64)) == 64 and g.logits_slots((4, -64)) == 20
    assert CudaGraphRunner(None, [], 16, torch.device("cpu"), 3, 5, 256, prefill_tokens=16).prefill_keys() == \
        [(1, -16), (2, -16), (3, -16)]


@pytest.mark.parametrize("block_size", [16, 4])
def test_mixed_steps_equal_eager(tiny: str, block_size: int) -> None:
    prompts = make_prompts(10)
    kw = dict(max_num_seqs=4, block_size=block_size)
    eager = staggered(make_llm(tiny, False, **kw), prompts)
    llm = make_llm(tiny, True, **kw)
    keys = spy_keys(llm.engine.runner.graph_runner)
    assert staggered(llm, prompts) == eager
    g = llm.engine.runner.graph_runner
    assert g.num_mixed > 0, "no step with prefill rows took a prefill graph"
    assert g.num_mixed == sum(q < 0 for _, q in keys), "a step with prefill rows ran more than one replay"
    assert any(q > 0 for _, q in keys), "no decode graph ran"


def test_chunked_prefill_and_speculation_on_graphs(tiny: str) -> None:
    """Chunks of 24 tokens (prompts span several; a chunk that ends mid-prompt wants no logits) and
    ngram verify rows beside prefill rows."""
    prompts = [p * 3 for p in make_prompts(8)]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
            "adaptive_draft_length": False}
    kw = dict(max_num_seqs=3, max_num_batched_tokens=24)
    eager = staggered(make_llm(tiny, False, **kw), prompts)
    llm = make_llm(tiny, True, spec, **kw)
    seen: list = []
    spy_keys(llm.engine.runner.graph_runner, seen)
    assert staggered(llm, prompts) == eager
    mixed = [(d, drafts, no_logits) for key, d, drafts, no_logits in seen if key[1] < 0]
    assert any(d > 0 and drafts > 0 for d, drafts, _ in mixed), "no verify rows beside prefill rows on a graph"
    assert any(no_logits > 0 for _, _, no_logits in mixed), "no mid-prompt chunk on a prefill graph"


def test_long_prefill_runs_eagerly(tiny: str) -> None:
    """A prefill part above the largest prefill graph runs eagerly and still gives the same tokens."""
    prompts = [p * 4 for p in make_prompts(3)]
    eager = staggered(make_llm(tiny, False, max_num_seqs=2), prompts)
    llm = make_llm(tiny, True, max_num_seqs=2, prefill_tokens=16)
    keys = spy_keys(llm.engine.runner.graph_runner)
    assert staggered(llm, prompts) == eager
    assert keys and all(q > 0 or -q <= 16 for _, q in keys)


def test_prefill_graph_eligibility() -> None:
    """Steps of up to PREFILL_GRAPH_ROWS rows and prefill_tokens tokens, each row wanting at most
    max_q logits, get a key; more rows, more tokens or more logits a row do not."""
    from types import SimpleNamespace

    g = CudaGraphRunner(None, [], 16, torch.device("cpu"), 32, 5, 256, prefill_tokens=64)

    def batch(q_lens, logits=None):
        qsl = np.concatenate(([0], np.cumsum(q_lens)))
        nl = np.ones(len(q_lens), np.int64) if logits is None else np.array(logits)
        return SimpleNamespace(query_start_loc=qsl, context_lens=np.array(q_lens),
                               block_tables=np.zeros((len(q_lens), 2), np.int32), num_logits=nl)

    assert g.prefill_key_for(batch([5, 7, 2])) == (4, -16)
    assert g.prefill_key_for(batch([30, 20], logits=[0, 1])) == (2, -64)
    assert g.prefill_key_for(batch([5, 5, 40], logits=[5, 5, 1])) == (4, -64)  # verify rows beside a prompt
    assert g.prefill_key_for(batch([1] * 17)) == (32, -32)                    # rows bucket 32, t >= b
    assert g.prefill_key_for(batch([1] * 33)) is None         # more rows than the largest bucket
    assert g.prefill_key_for(batch([40, 30])) is None         # more tokens than the largest capacity
    assert g.prefill_key_for(batch([8, 2], logits=[6, 1])) is None  # a row wanting more than max_q logits
