"""A drafting layer's catch-up deferred to the steps that draft (MtpProposer with its HiddenRing): a
row the draft-length policy leaves without drafts keeps its step's hidden states in the ring and
catches up when it next drafts. The layer then computes the same cache entries later, so every step
drafts exactly what catching up every step drafts (the CPU's arithmetic does not depend on how many
positions one forward feeds), with fewer layer forwards; a quiet spell longer than the ring holds
forces a catch-up instead of losing positions (MtpProposer.slide off; on, the spell's oldest
positions are skipped and quiet rows run no forward at all); output equals plain decoding. On a tiny DeepSeek-V3
with an MTP layer, with prefix caching, prompts admitted in chunks (mixed steps) and preemption."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pyengine import LLM, SamplingParams
from pyengine.spec_decode.head_graphs import HeadGraphs
from tests.spec_harness import plain_greedy
from tests.tiny_models import make_deepseek_checkpoint, make_prompts

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("dsv3_lazy"))
    make_deepseek_checkpoint(path, mtp_agreement=0.01, layer_scale=0.02)
    return path


class PatternPolicy:
    """Request r drafts k at the steps where (r + step) % period == 0, nothing otherwise."""

    def __init__(self, k: int, period: int) -> None:
        self.k, self.period, self.step = k, period, 0

    def draft_lengths(self, slots, seq_ids, can_finish_last=None) -> np.ndarray:
        self.step += 1
        return np.where((np.asarray(seq_ids) + self.step) % self.period == 0, self.k, 0).astype(np.int32)

    def observe_rows(self, *args) -> None:
        pass

    def expects_no_drafts(self) -> bool:
        return False


class DraftLog:
    """The scheduler, recording the drafts the proposer sets at each step."""

    def __init__(self, inner) -> None:
        self.inner, self.steps = inner, []

    def schedule(self):
        self.steps.append([])
        return self.inner.schedule()

    def set_draft_tokens_batch(self, seq_ids, flat, counts):
        self.steps[-1].append((seq_ids.tolist(), flat.tolist(), counts.tolist()))
        return self.inner.set_draft_tokens_batch(seq_ids, flat, counts)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def run(target: str, lazy: bool, period: int, ring: int | None = None, batch: int = 8, k: int = 3,
        graphs: bool = False, slide: bool = False, **kw):
    llm = LLM(target, device="cpu", max_num_batched_tokens=48,
              speculative_config={"method": "mtp", "num_speculative_tokens": k, "adaptive_draft_length": False}, **kw)
    eng = llm.engine
    if graphs:  # the CUDA-graph path's static buffers (run eagerly on the CPU): short catch-ups take it
        r, cfg = eng.runner, eng.cfg
        eng.proposer.set_graphs(HeadGraphs(eng.proposer.layer, eng.proposer.kv_cache, r.block_size, r.device,
                                           cfg.max_num_seqs, k + 1, cfg.max_model_len + k + 1 + r.block_size))
    eng.draft_length = PatternPolicy(k, period)
    eng.proposer.lazy, eng.proposer.slide = lazy, slide
    if ring is not None:
        eng.proposer.ring.size = ring
    log = DraftLog(eng.scheduler)
    eng.scheduler = log
    proposer, gathers = eng.proposer, []
    forward, gather = proposer._forward, proposer.ring.gather

    fed = []

    def logged_forward(feed, prev_hidden, logit_rows, token_ids=None):
        fed.append(len(feed.positions))
        out, logits = forward(feed, prev_hidden, logit_rows, token_ids)
        if logits.numel():  # the drafting rows' logits, every draft position
            log.steps[-1].append(logits.clone())
        return out, logits

    proposer._forward = logged_forward
    proposer.ring.gather = lambda *a: gathers.append(1) or gather(*a)
    outs = llm.generate(make_prompts(batch), SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                        use_tqdm=False)
    assert all(o.error is None for o in outs)
    stats = dict(llm.stats(), ring_gathers=len(gathers), fed_tokens=sum(fed))
    return [tuple(o.outputs[0].token_ids) for o in outs], log.steps, proposer.num_forwards, stats


def same_steps(a: list, b: list) -> bool:
    """Step by step the same drafts set and the same draft logits, bit for bit."""
    return len(a) == len(b) and all(
        len(x) == len(y) and all(torch.equal(u, v) if isinstance(u, torch.Tensor) else u == v for u, v in zip(x, y))
        for x, y in zip(a, b))


@pytest.mark.parametrize("period,ring,kw", [
    (3, None, {}),
    (5, None, {"enable_prefix_caching": True}),
    (13, 9, {}),  # quiet spells longer than the ring holds: forced catch-ups
    (4, None, {"num_kv_blocks": 40, "block_size": 4}),  # preemption: the ring's rows are dropped
    (3, None, {"graphs": True}),
])
def test_deferred_catch_up_drafts_what_catching_up_every_step_drafts(target: str, period: int, ring, kw) -> None:
    eager_out, eager_steps, eager_forwards, eager_stats = run(target, False, period, ring, **kw)
    lazy_out, lazy_steps, lazy_forwards, lazy_stats = run(target, True, period, ring, **kw)
    plain = list(plain_greedy(target, 8, MAX_TOKENS)[0])
    assert eager_out == plain and lazy_out == plain
    assert same_steps(lazy_steps, eager_steps), "a deferred catch-up changed what was drafted"
    assert lazy_stats["ring_gathers"] > 0 and eager_stats["ring_gathers"] == 0
    assert lazy_stats["num_draft_tokens"] > 0 and 0 < lazy_stats["acceptance_rate"] < 1
    assert lazy_forwards < eager_forwards, (lazy_forwards, eager_forwards)
    if "num_kv_blocks" in kw:
        assert lazy_stats["num_preemptions"] > 0


def test_quiet_rows_run_no_layer_forward(target: str) -> None:
    """With no row drafting, decode steps run no layer forward at all (only prompts' chunks too long
    for the ring, and the forced catch-ups of spells the ring cannot hold, do)."""
    out, steps, forwards, stats = run(target, True, period=10**9)
    assert out == list(plain_greedy(target, 8, MAX_TOKENS)[0])
    assert stats["num_draft_tokens"] == 0
    _, _, eager_forwards, _ = run(target, False, period=10**9)
    assert forwards <= eager_forwards // 4, (forwards, eager_forwards)


def test_sliding_quiet_rows_skip_what_the_ring_cannot_hold(target: str) -> None:
    """MtpProposer.slide: a quiet spell longer than the ring keeps the latest positions and skips the
    older ones instead of forcing a catch-up. Rows that never draft then feed the layer nothing but
    the prompt chunks too long for the ring, rows that draft now and then catch up at most the
    ring's room each time (fewer forwards), some drafts change (skipped entries stay stale), and
    the output is plain decoding's."""
    plain = list(plain_greedy(target, 8, MAX_TOKENS)[0])
    forced = run(target, True, period=10**9, ring=9)
    quiet = run(target, True, period=10**9, ring=9, slide=True)
    assert forced[0] == plain and quiet[0] == plain
    assert quiet[3]["num_draft_tokens"] == 0 and quiet[2] < forced[2], (quiet[2], forced[2])
    assert 0 < quiet[3]["fed_tokens"] <= quiet[3]["prompt_tokens"] < forced[3]["fed_tokens"]
    slid = run(target, True, period=13, ring=9, slide=True)
    kept = run(target, True, period=13, ring=9)
    assert slid[0] == plain and kept[0] == plain
    assert slid[3]["num_draft_tokens"] > 0 and slid[2] < kept[2], (slid[2], kept[2])
    assert not same_steps(slid[1], kept[1]), "skipped positions should change some draft (stale entries)"
