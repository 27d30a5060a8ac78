"""EAGLE-3 with its head's forwards replayed from CUDA graphs (pyengine/spec_decode/head_graphs.py)
on the default model (SmolLM2 GGUF, bf16) and the shipped head: the head's graphs replay, greedy
output equals plain output bit for bit (tokens and logits; batch_invariant=True, so verify steps and
decode steps share their numbers) at batch 1 and 6, and the drafts equal those of the head's eager
forwards (batch invariance: the padded graph rows change no real row's numbers); with verify steps
built on the device (layer_device_drafts.py) every step's drafts equal the host path's (the catch-up
over a whole verify step computes the kept positions' entries as the host's shorter one does).
Skips without CUDA."""
from __future__ import annotations

import gc

import pytest
import torch

from pyengine import LLM, SamplingParams
from pyengine.engine.host_arrays import draft_token_ids
from pyengine.models.eagle3 import SHIPPED_HEAD
from tests.test_batch_invariance_gpu import PROMPTS, assert_identical, run
from tests.test_gpu_e2e import gguf  # noqa: F401  (the SmolLM2 GGUF fixture)
from tests.test_head_graphs import record_drafts

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

MAX_TOKENS = 48


def eagle3_run(gguf: str, prompts: list[str], k: int, head_graphs: bool = True,  # noqa: F811
               prefill_graphs: bool = True, device_loop: bool = False, steps: list | None = None):
    """(outputs as run() gives them, every propose() call's drafts, the proposer's graph runner
    counters and the target's count of steps with prefill rows on graphs). prefill_graphs False:
    those eagerly. device_loop: verify steps built on the device (off: every step's drafts come
    from propose()); steps: receives every step's (rows, drafts per row, drafts) and, last, the
    loop's count of steps used."""
    llm = LLM(model=gguf, device="cuda", dtype="bfloat16", batch_invariant=True, num_kv_blocks=4096,
              max_model_len=2048, max_num_batched_tokens=512,
              speculative_config={"method": "eagle3", "model": SHIPPED_HEAD, "num_speculative_tokens": k,
                                  "adaptive_draft_length": False})
    proposer = llm.engine.proposer
    graphs = proposer.graphs
    assert graphs is not None and graphs.use_graphs, "a CUDA target with graphs: the head gets graphs too"
    if not head_graphs:
        proposer.set_graphs(None)
    target_graphs = llm.engine.runner.graph_runner
    if not prefill_graphs:
        target_graphs.prefill_buckets = []  # execute_mixed declines: prefill steps run eagerly
    if not device_loop:
        llm.engine.device_verify = None
    if steps is not None:
        commit = llm.engine._commit

        def record(batch, *args):
            steps.append((tuple(batch.seq_ids.tolist()), tuple(batch.num_draft_tokens.tolist()),
                          tuple(draft_token_ids(batch).tolist())))
            return commit(batch, *args)
        llm.engine._commit = record
    drafts = record_drafts(proposer)
    llm.engine.cfg.record_logits = not device_loop  # (recorded logits keep steps from launching ahead)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    reqs = llm.run_requests([(p, llm.tokenizer.encode(p)) for p in prompts], [params] * len(prompts))
    out = [(r.output_token_ids, torch.stack(r.logits) if r.logits else None) for r in reqs]
    counts = (graphs.num_replays, graphs.num_eager, sorted(graphs.graphs), target_graphs.num_mixed)
    if steps is not None and device_loop:
        steps.append(llm.engine.device_verify.num_used)
    stats = llm.stats()
    del llm, proposer, target_graphs
    gc.collect()
    torch.cuda.empty_cache()
    return out, drafts, stats, counts


@pytest.mark.parametrize("batch,k", [(1, 4), (6, 3)])
def test_eagle3_head_graphs_equal_plain(gguf: str, batch: int, k: int) -> None:  # noqa: F811
    prompts = PROMPTS[:batch]
    plain = run(gguf, prompts, MAX_TOKENS)
    out, drafts, stats, (replays, eager, keys, _) = eagle3_run(gguf, prompts, k)
    assert replays > 0 and eager == 0, (replays, eager)
    assert any(q > 1 for _, q in keys), f"no catch-up after accepted drafts replayed a graph: {keys}"
    assert stats["num_draft_tokens"] > 0 and stats["acceptance_rate"] > 0, stats
    assert_identical(out, plain, f"eagle3 k={k} with head graphs vs plain")


def test_head_graph_drafts_equal_eager_drafts(gguf: str) -> None:  # noqa: F811
    prompts = PROMPTS[:4]
    out, drafts, _, (replays, _, _, _) = eagle3_run(gguf, prompts, 3)
    eager_out, eager_drafts, _, (eager_replays, _, _, _) = eagle3_run(gguf, prompts, 3, head_graphs=False)
    assert replays > 0 and eager_replays == 0
    assert_identical(out, eager_out, "eagle3 with vs without head graphs")
    assert drafts == eager_drafts


def test_prefills_on_graphs_give_the_head_the_same_aux_states(gguf: str) -> None:  # noqa: F811
    """Prefill steps replay prefill graphs with EAGLE-3 too (the aux states read after each replay):
    the same drafts and output as with those steps eager."""
    prompts = PROMPTS[:4]
    out, drafts, _, (_, _, _, mixed) = eagle3_run(gguf, prompts, 3)
    eager_out, eager_drafts, _, (_, _, _, eager_mixed) = eagle3_run(gguf, prompts, 3, prefill_graphs=False)
    assert mixed > 0 and eager_mixed == 0, (mixed, eager_mixed)
    assert_identical(out, eager_out, "eagle3 with vs without prefill graphs")
    assert drafts == eager_drafts


@pytest.mark.parametrize("batch,k", [(1, 4), (6, 3)])
def test_eagle3_device_loop_drafts_as_the_host(gguf: str, batch: int, k: int) -> None:  # noqa: F811
    prompts = PROMPTS[:batch]
    plain = run(gguf, prompts, MAX_TOKENS)
    loop_steps: list = []
    host_steps: list = []
    out, _, stats, _ = eagle3_run(gguf, prompts, k, device_loop=True, steps=loop_steps)
    host_out, _, _, _ = eagle3_run(gguf, prompts, k, steps=host_steps)
    used = loop_steps.pop()
    assert used > len(loop_steps) // 3, (used, len(loop_steps))
    assert [toks for toks, _ in out] == [toks for toks, _ in plain], f"eagle3 k={k} with the device loop vs plain"
    assert_identical(host_out, plain, f"eagle3 k={k} on the host's paths vs plain")
    assert loop_steps == host_steps


def test_capture_graphs_leaves_nothing_to_capture_mid_run(gguf: str) -> None:  # noqa: F811
    """LLMEngine.capture_graphs captures the head's catch-up and chain graphs (and the device loop's
    chains) with the target's: a run afterwards, device loop on, batch 1 and 6, captures none."""
    llm = LLM(model=gguf, device="cuda", dtype="bfloat16", max_model_len=2048,
              speculative_config={"method": "eagle3", "model": SHIPPED_HEAD, "num_speculative_tokens": 4,
                                  "adaptive_draft_length": False})
    eng, proposer = llm.engine, llm.engine.proposer
    captured = eng.capture_graphs()
    head, chain, target = len(proposer.graphs.graphs), len(proposer.chain.graphs), len(eng.runner.graph_runner.graphs)
    assert captured == head + chain + target and head > 0 and chain > 0
    assert any(len(key) == 3 for key in proposer.chain.graphs), "the device loop's chains"
    assert eng.capture_graphs() == 0
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for prompts in (PROMPTS[:1], PROMPTS[:6]):
        llm.generate(prompts, params, use_tqdm=False)
    assert eng.device_verify.num_used > 0
    assert (len(proposer.graphs.graphs), len(proposer.chain.graphs), len(eng.runner.graph_runner.graphs)) == \
        (head, chain, target), "a graph was captured mid-run"
