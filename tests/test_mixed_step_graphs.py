"""Steps with prefill rows on graphs (CudaGraphRunner.execute_mixed), run on the CPU through the
runner's static-buffer path: the decode/verify rows replay their decode graph and the prefill rows
a prefill graph (each row's last-token logits only). Tokens must equal the eager runner's through
staggered admissions (prefill rows beside decode and verify rows), chunked prefill (chunks that
want no logits), prefill-only steps and speculation."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pyengine import LLM, SamplingParams
from pyengine.engine.cuda_graph_runner import CudaGraphRunner
from pyengine.engine.graph_capture import default_token_buckets, graph_shape
from pyengine.engine.step_parts import rows_of
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


def spy_keys(g: CudaGraphRunner) -> list[tuple[int, int]]:
    """The graph keys the runner stages (CPU: no graph is captured, the same buffers run eagerly)."""
    keys: list[tuple[int, int]] = []
    orig = g._execute_part

    def spy(part, key, *patch):
        keys.append(key)
        return orig(part, key, *patch)

    g._execute_part = spy
    return keys


def test_token_buckets_and_shapes() -> None:
    assert default_token_buckets(100) == [16, 32, 64]
    assert default_token_buckets(8) == []
    assert graph_shape((4, 3)) == (4, 3, 12, False)
    assert graph_shape((2, -64)) == (2, 64, 64, True)
    g = CudaGraphRunner(None, [], 16, torch.device("cpu"), 32, 5, 256, prefill_tokens=64)
    assert g.prefill_keys() == [(b, -t) for b in (1, 2, 4, 8) for t in (16, 32, 64)]
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
    assert llm.engine.runner.graph_runner.num_mixed > 0, "no step with prefill rows took a prefill graph"
    assert any(q < 0 for _, q in keys), "no prefill graph ran"
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
    seen = []
    g = llm.engine.runner.graph_runner
    orig = g.execute_mixed

    def spy(batch, *args):
        out = orig(batch, *args)
        if out is not None:
            seen.append((int(batch.num_decode_rows), int(np.asarray(batch.num_draft_tokens).sum()),
                         int((np.asarray(batch.num_logits)[batch.num_decode_rows:] == 0).sum())))
        return out

    g.execute_mixed = spy
    assert staggered(llm, prompts) == eager
    assert any(d > 0 and drafts > 0 for d, drafts, _ in seen), "no verify rows beside prefill rows on graphs"
    assert any(no_logits > 0 for _, _, no_logits in seen), "no mid-prompt chunk on a prefill graph"


def test_long_prefill_runs_eagerly(tiny: str) -> None:
    """A prefill part above the largest prefill graph runs eagerly and still gives the same tokens."""
    prompts = [p * 4 for p in make_prompts(3)]
    eager = staggered(make_llm(tiny, False, max_num_seqs=2), prompts)
    llm = make_llm(tiny, True, max_num_seqs=2, prefill_tokens=16)
    keys = spy_keys(llm.engine.runner.graph_runner)
    assert staggered(llm, prompts) == eager
    assert keys and all(q > 0 or -q <= 16 for _, q in keys)


def test_prefill_graph_eligibility(tiny: str) -> None:
    """Prefill parts of up to PREFILL_GRAPH_ROWS rows and prefill_tokens tokens get a key; more
    rows, more tokens or a row wanting logits other than its last token's do not."""
    from pyengine.engine.step_parts import StepPart

    g = CudaGraphRunner(None, [], 16, torch.device("cpu"), 32, 5, 256, prefill_tokens=64)

    def part(q_lens, logits=None):
        qsl = np.concatenate(([0], np.cumsum(q_lens)))
        nl = np.ones(len(q_lens), np.int64) if logits is None else np.array(logits)
        return StepPart(np.arange(len(q_lens)), np.zeros(qsl[-1]), np.zeros(qsl[-1]), np.zeros(qsl[-1]), qsl,
                        np.array(q_lens), np.zeros((len(q_lens), 2), np.int32), nl, (qsl[1:] - 1)[nl == 1], 0)

    assert g.prefill_key_for(part([5, 7, 2])) == (4, -16)
    assert g.prefill_key_for(part([30, 20], logits=[0, 1])) == (2, -64)
    assert g.prefill_key_for(part([1] * 9)) is None          # more rows than a prefill graph takes
    assert g.prefill_key_for(part([40, 30])) is None         # more tokens than the largest capacity
    bad = part([5, 7])
    bad.logits_indices = np.array([0, 11])                   # a logits row that is not the row's last token
    assert g.prefill_key_for(bad) is None


def test_rows_of_splits_a_batch(tiny: str) -> None:
    llm = make_llm(tiny, False, max_num_seqs=4)
    eng = llm.engine
    for p in make_prompts(2):
        eng.add_request(p, SamplingParams(temperature=0, max_tokens=4))
    eng.step()
    eng.add_request(make_prompts(3)[2], SamplingParams(temperature=0, max_tokens=4))
    batch = eng.scheduler.schedule()
    d = int(batch.num_decode_rows)
    assert 0 < d < batch.num_rows, "the step should mix decode rows and a prefill row"
    pre, dec = rows_of(batch, d, batch.num_rows), rows_of(batch, 0, d)
    assert pre.num_decode_rows == 0 and dec.num_decode_rows == d
    assert dec.num_tokens + pre.num_tokens == batch.num_tokens
    assert np.array_equal(np.concatenate([dec.input_ids, pre.input_ids]), batch.input_ids)
    assert pre.query_start_loc[0] == 0 and np.array_equal(pre.logits_indices, pre.query_start_loc[1:] - 1)
    assert torch.equal(torch.from_numpy(pre.block_tables), torch.from_numpy(np.asarray(batch.block_tables)[d:]))
