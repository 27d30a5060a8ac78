"""The drafting layer's graph runner (pyengine/spec_decode/head_graphs.py) on the CPU, where its
static-buffer path runs eagerly as a replay would: for an EAGLE-3 head and a DeepSeek MTP layer,
batch 1 and several rows, k = 1..4, ragged catch-ups (rows that accepted different counts) and
padded buckets, the drafts of every step equal the eager proposer's bit for bit and greedy output
equals plain output; the padding rows write no KV (the head's cache outside the rows' slots is
untouched) and the outputs and logits equal an eager forward of the same rows."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pyengine import LLM, SamplingParams
from pyengine.models.eagle3 import load_eagle3
from pyengine.spec_decode.head_graphs import HeadFeed, HeadGraphs
from tests.spec_harness import plain_greedy
from tests.test_eagle3 import head, target  # noqa: F401  (module fixtures: the tiny target and its trained head)
from tests.tiny_models import make_deepseek_checkpoint, make_prompts

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def mtp_target(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("dsv3_mtp_graphs"))
    make_deepseek_checkpoint(path, mtp_agreement=0.01, layer_scale=0.02)
    return path


def _attach(llm: LLM) -> HeadGraphs:
    """CPU: the proposer's short forwards through a HeadGraphs (static buffers, run eagerly)."""
    p, r, cfg = llm.engine.proposer, llm.engine.runner, llm.engine.cfg
    g = HeadGraphs(p.layer, p.kv_cache, r.block_size, r.device, cfg.max_num_seqs, p.k + 1,
                   cfg.max_model_len + p.k + 1 + r.block_size)
    p.set_graphs(g)
    return g


def record_drafts(proposer) -> list[dict[int, list[int]]]:
    """Every propose() call's drafts (seq id -> drafts), appended to the returned list."""
    drafts: list[dict[int, list[int]]] = []
    propose = proposer.propose

    def record(*args):
        propose(*args)
        drafts.append({sid: list(d) for sid, (d, _) in proposer.sampler.pending.items()})
    proposer.propose = record
    return drafts


def _drafting_run(path: str, spec: dict, batch: int, graphs: bool, params: SamplingParams, **kw):
    """Outputs, every step's drafts (seq id -> drafts) and the graph keys the static path ran."""
    llm = LLM(path, device="cpu", speculative_config=spec, max_num_batched_tokens=64, **kw)
    proposer = llm.engine.proposer
    assert proposer.graphs is None, "a CPU runner has no graph runner: eager unless attached"
    keys: list[tuple[int, int]] = []
    if graphs:
        g = _attach(llm)
        run = g.run

        def spy(key, feed, prev, token_ids=None):
            keys.append(key)
            assert len(feed.context_lens) <= key[0] and feed.max_query_len == key[1]
            return run(key, feed, prev, token_ids)
        g.run = spy
    drafts = record_drafts(proposer)
    outs = llm.generate(make_prompts(batch), params, use_tqdm=False)
    assert all(o.error is None for o in outs)
    return [tuple(o.outputs[0].token_ids) for o in outs], drafts, keys, llm


GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _check_same_drafts(path: str, spec: dict, batch: int, params: SamplingParams = GREEDY, **kw) -> list:
    eager_out, eager_drafts, _, _ = _drafting_run(path, spec, batch, False, params, **kw)
    out, drafts, keys, llm = _drafting_run(path, spec, batch, True, params, **kw)
    assert any(drafts), "no step drafted"
    assert drafts == eager_drafts, "the static-buffer path drafted differently from the eager forwards"
    assert out == eager_out
    if params.temperature == 0:
        assert list(out) == list(plain_greedy(path, batch, MAX_TOKENS)[0])
    g = llm.engine.proposer.graphs
    assert g.num_eager == len(keys) > 0 and g.num_replays == 0, "CPU: the static path runs, nothing replays"
    return keys


@pytest.mark.parametrize("batch,k,block_size", [(1, 1, 16), (1, 4, 1), (3, 2, 16), (8, 3, 16), (8, 4, 1)])
def test_eagle3_static_path_drafts_like_eager(target: str, head: str, batch: int, k: int,  # noqa: F811
                                             block_size: int) -> None:
    spec = {"method": "eagle3", "model": head, "num_speculative_tokens": k, "adaptive_draft_length": False}
    keys = _check_same_drafts(target, spec, batch, block_size=block_size)
    if k > 1:
        assert any(q > 1 for _, q in keys), "no catch-up of a row that accepted drafts took the static path"
    if batch == 3:
        assert any(b == 4 for b, _ in keys), "no padded bucket (3 rows in a bucket of 4)"


@pytest.mark.parametrize("batch,k,block_size", [(1, 3, 16), (5, 4, 16), (8, 2, 1)])
def test_mtp_static_path_drafts_like_eager(mtp_target: str, batch: int, k: int, block_size: int) -> None:
    spec = {"method": "mtp", "num_speculative_tokens": k, "adaptive_draft_length": False}
    keys = _check_same_drafts(mtp_target, spec, batch, block_size=block_size)
    assert any(q > 1 for _, q in keys)


def test_random_sampling_same_draws(mtp_target: str) -> None:
    """Random rows: the draft distribution q is the same bits on both paths, so the same seed draws
    the same drafts and the same output."""
    spec = {"method": "mtp", "num_speculative_tokens": 3, "adaptive_draft_length": False}
    _check_same_drafts(mtp_target, spec, 4, SamplingParams(temperature=1.0, seed=7, max_tokens=MAX_TOKENS,
                                                           ignore_eos=True))


@torch.inference_mode()
def test_padding_rows_write_no_kv(target: str, head: str) -> None:  # noqa: F811
    """3 ragged rows (1, 3 and 2 tokens) in the graph of bucket 4, q = 3 (5 padding rows): the head's
    KV cache afterwards equals an eager forward's (which writes only the rows' slots), every entry
    outside those slots keeps its old value, and outputs and logits are the eager forward's."""
    llm = LLM(target, device="cpu")
    layer, _ = load_eagle3(head, llm.model, llm.model_config, torch.device("cpu"), torch.float32)
    B, blocks = 16, 12  # the runner's block size: build_metadata's
    torch.manual_seed(0)
    before = tuple(torch.randn(blocks, B, layer.config.num_key_value_heads, layer.config.head_dim) for _ in range(2))
    tables = np.array([[1, 2, -1], [3, 4, 5], [6, 7, -1]], dtype=np.int32)  # block 0 unused: slot 0 stays
    starts, lens = np.array([5, 9, 2]), np.array([1, 3, 2])
    ids = np.array([7, 11, 12, 13, 40, 41], dtype=np.int64)
    feed = HeadFeed.build(tables, starts, lens, B, ids)
    prev = torch.randn(6, layer.config.hidden_size)

    eager_kv = tuple(t.clone() for t in before)
    out = layer(torch.from_numpy(ids), torch.from_numpy(feed.positions), prev,
                llm.engine.runner.build_metadata(feed), eager_kv)
    logits = layer.compute_logits(out.index_select(0, torch.tensor([0, 3, 5])))

    static_kv = tuple(t.clone() for t in before)
    g = HeadGraphs(layer, static_kv, B, torch.device("cpu"), 8, 3, 64)
    assert llm.engine.runner.block_size == B
    key = g.key_for(feed)
    assert key == (4, 3)
    g_out, g_logits = g.run(key, feed, prev)
    assert torch.equal(g_out, out) and torch.equal(g_logits, logits)
    written = np.zeros(blocks * B, dtype=bool)
    written[feed.slot_mapping] = True
    for eager, static, old in zip(eager_kv, static_kv, before):
        assert torch.equal(static, eager), "the padded forward wrote the head's KV where an eager one does not"
        unchanged = ~torch.from_numpy(written)
        assert torch.equal(static.flatten(0, 1)[unchanged], old.flatten(0, 1)[unchanged])
        assert not torch.equal(static.flatten(0, 1)[~unchanged], old.flatten(0, 1)[~unchanged])


def test_rows_over_max_q_stay_eager(target: str, head: str) -> None:  # noqa: F811
    """A prefill catch-up (more tokens than max_q) or a row past the graphs' block-table width gets no key."""
    llm = LLM(target, device="cpu")
    layer, _ = load_eagle3(head, llm.model, llm.model_config, torch.device("cpu"), torch.float32)
    kv = layer.make_kv_cache(8, 4, torch.device("cpu"))
    g = HeadGraphs(layer, kv, 4, torch.device("cpu"), 4, 3, 16)
    tables = np.arange(8, dtype=np.int32)[None]
    assert g.key_for(HeadFeed.build(tables, np.array([0]), np.array([3]), 4)) == (1, 3)
    assert g.key_for(HeadFeed.build(tables, np.array([0]), np.array([4]), 4)) is None
    assert g.key_for(HeadFeed.build(tables, np.array([20]), np.array([1]), 4)) is None
    assert g.key_for(HeadFeed.build(np.repeat(tables, 5, 0), np.zeros(5), np.ones(5), 4)) is None
    # with catch-up graphs: longer rows (deferred catch-ups) fit a prefill-shaped key of 16 or 32 slots
    g = HeadGraphs(layer, kv, 4, torch.device("cpu"), 4, 3, 32, catch_up_tokens=32)
    two = np.arange(16, dtype=np.int32).reshape(2, 8)
    assert g.key_for(HeadFeed.build(tables, np.array([0]), np.array([4]), 4)) == (1, -16)
    assert g.key_for(HeadFeed.build(two, np.array([0, 2]), np.array([9, 14]), 4)) == (2, -32)
    assert g.key_for(HeadFeed.build(two, np.array([0, 2]), np.array([19, 14]), 4)) is None  # 33 tokens


def test_catch_up_graphs_take_every_bucket_row(target: str, head: str) -> None:  # noqa: F811
    """Prefill-shaped catch-up graphs hold as many rows as the largest bucket (a drafting step at
    batch 16 catches up every drafting row's deferred positions at once), whatever the target's
    PREFILL_GRAPH_ROWS; more rows than the largest bucket get no key."""
    llm = LLM(target, device="cpu")
    layer, _ = load_eagle3(head, llm.model, llm.model_config, torch.device("cpu"), torch.float32)
    kv = layer.make_kv_cache(64, 4, torch.device("cpu"))
    g = HeadGraphs(layer, kv, 4, torch.device("cpu"), 16, 3, 32, catch_up_tokens=64)
    tables = np.arange(64, dtype=np.int32).reshape(16, 4) % 64
    assert g.prefill_rows == 16
    twelve = HeadFeed.build(tables[:12], np.zeros(12), np.full(12, 5), 4)  # 60 tokens, rows of 5 > max_q
    assert g.key_for(twelve) == (16, -64)
    wide = HeadFeed.build(np.repeat(tables[:1], 17, 0), np.zeros(17), np.full(17, 4), 4)
    assert g.key_for(wide) is None  # 17 rows: past the largest bucket
