"""Property tests of the C++ Scheduler driven by a fake model.

The fake model's next token is a fixed function of (request, position), so every request's output
is known in advance whatever happens on the way: chunked prefill, ragged drafts, partial
acceptance, prefix hits, preemption. A simulated KV store checks that each row reads back exactly
the (position, token) pairs of its own context, which is what a real forward pass would consume.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pyengine import _C

VOCAB = 50
STOP_TOKEN = 49


def next_token(seq_id: int, position: int, tokens: list[int]) -> int:
    """The fake model: token at `position`, a function of the request's committed history."""
    return (seq_id * 7 + position * 13 + tokens[position - 1] * 3) % (VOCAB - 1)


def make_scheduler(**kw: int | bool) -> _C.Scheduler:
    cfg = _C.SchedulerConfig()
    for key, value in kw.items():
        setattr(cfg, key, value)
    return _C.Scheduler(cfg)


class FakeEngine:
    def __init__(self, sched: _C.Scheduler, block_size: int, num_blocks: int, rng: np.random.Generator,
                 k: int, accept_prob: float) -> None:
        self.s, self.B, self.rng, self.k, self.accept_prob = sched, block_size, rng, k, accept_prob
        self.kv_pos = np.full(num_blocks * block_size, -1)
        self.kv_tok = np.full(num_blocks * block_size, -1)
        self.tokens: dict[int, list[int]] = {}  # mirror of committed tokens
        self.prompt_len: dict[int, int] = {}
        self.finished: dict[int, str | None] = {}

    def add(self, seq_id: int, prompt: list[int], max_tokens: int, stop: bool) -> None:
        self.s.add_request(seq_id, prompt, max_tokens, stop_token_ids=[STOP_TOKEN] if stop else [])
        self.tokens[seq_id] = list(prompt)
        self.prompt_len[seq_id] = len(prompt)

    def propose(self) -> None:
        for sid in self.s.running_ids():
            toks = self.tokens[sid]
            if self.s.num_computed(sid) != len(toks) - 1:
                continue
            d = int(self.rng.integers(0, self.k + 1))
            drafts, hist = [], list(toks)
            for _ in range(d):  # a draft is right with probability accept_prob
                good = next_token(sid, len(hist), hist)
                tok = good if self.rng.random() < self.accept_prob else (good + 1) % (VOCAB - 1)
                drafts.append(tok)
                hist.append(tok)
            self.s.set_draft_tokens(sid, drafts)

    def step(self, budget: int, max_seqs: int) -> None:
        b = self.s.schedule()
        assert b.num_tokens <= budget and b.num_rows <= max_seqs
        qsl, ctx, nc = b.query_start_loc, b.context_lens, b.num_computed
        # slot_mapping covers exactly [num_computed, num_computed + scheduled) of each row
        for r in range(b.num_rows):
            sid = int(b.seq_ids[r])
            lo, hi = int(qsl[r]), int(qsl[r + 1])
            assert list(b.positions[lo:hi]) == list(range(nc[r], ctx[r]))
            table = b.block_tables[r]
            expect = [table[p // self.B] * self.B + p % self.B for p in range(nc[r], ctx[r])]
            assert list(b.slot_mapping[lo:hi]) == expect
            # inputs: committed tokens, then this step's drafts
            hist = self.tokens[sid]
            for i, p in enumerate(range(nc[r], ctx[r])):
                if p < len(hist):
                    assert b.input_ids[lo + i] == hist[p]
        assert len(set(b.slot_mapping.tolist())) == b.num_tokens, "two tokens write one slot"
        # the forward pass: write KV, then every row reads its whole context
        self.kv_pos[b.slot_mapping] = b.positions
        self.kv_tok[b.slot_mapping] = b.input_ids
        counts = np.zeros(b.num_rows, dtype=np.int32)
        out: list[int] = []
        for r in range(b.num_rows):
            sid = int(b.seq_ids[r])
            lo, hi = int(qsl[r]), int(qsl[r + 1])
            inputs = list(b.input_ids[lo:hi])
            seen = list(self.tokens[sid][: nc[r]]) + inputs
            table = b.block_tables[r]
            slots = [table[p // self.B] * self.B + p % self.B for p in range(ctx[r])]
            assert list(self.kv_pos[slots]) == list(range(ctx[r])), f"row {r} reads stale positions"
            assert list(self.kv_tok[slots]) == seen, f"row {r} reads another request's KV"
            if b.num_logits[r] == 0:
                continue
            # greedy verification against the fake model
            hist = list(self.tokens[sid])
            d = int(b.num_draft_tokens[r])
            drafts = inputs[1:] if d else []
            committed = []
            for j in range(d + 1):
                tok = next_token(sid, len(hist), hist)
                committed.append(tok)
                hist.append(tok)
                if j < d and drafts[j] != tok:
                    break
            counts[r] = len(committed)
            out.extend(committed)
        num_committed, reasons = self.s.update(np.array(out, dtype=np.int32), counts)
        off = 0
        for r in range(b.num_rows):
            sid = int(b.seq_ids[r])
            self.tokens[sid].extend(out[off:off + num_committed[r]])
            off += counts[r]
            if reasons[r]:
                self.finished[sid] = _C.FINISH_REASONS[reasons[r]]


def expected_output(sid: int, prompt: list[int], max_tokens: int, stop: bool, max_model_len: int) -> list[int]:
    hist = list(prompt)
    while len(hist) - len(prompt) < max_tokens and len(hist) < max_model_len:
        tok = next_token(sid, len(hist), hist)
        hist.append(tok)
        if stop and tok == STOP_TOKEN:
            break
    return hist[len(prompt):]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31), block_size=st.sampled_from([1, 2, 4, 16]), k=st.integers(0, 6),
       budget=st.integers(8, 64), max_seqs=st.integers(1, 12), prefix=st.booleans(),
       accept_prob=st.sampled_from([0.0, 0.5, 0.9, 1.0]), spare_blocks=st.integers(0, 12),
       lookahead=st.booleans())
def test_every_request_finishes_with_exactly_its_tokens(seed: int, block_size: int, k: int, budget: int,
                                                       max_seqs: int, prefix: bool, accept_prob: float,
                                                       spare_blocks: int, lookahead: bool) -> None:
    rng = np.random.default_rng(seed)
    max_model_len = 64
    # The pool fits the largest single request plus a little: others get preempted.
    worst = -(-(max_model_len + k) // block_size)
    num_blocks = worst + spare_blocks
    sched = make_scheduler(max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=max_model_len,
                           block_size=block_size, num_kv_blocks=num_blocks, enable_prefix_caching=prefix,
                           num_spec_tokens=k, decode_lookahead=lookahead)
    eng = FakeEngine(sched, block_size, num_blocks, rng, k, accept_prob)
    shared_prefix = [int(t) for t in rng.integers(0, VOCAB - 1, size=20)]
    requests = {}
    next_id, steps = 0, 0
    while next_id < 10 or sched.has_unfinished():
        if next_id < 10 and rng.random() < 0.4:  # random arrivals
            plen = int(rng.integers(1, 30))
            prompt = shared_prefix[:plen] if rng.random() < 0.5 else [int(t) for t in rng.integers(0, VOCAB - 1, size=plen)]
            max_tokens = int(rng.integers(1, max_model_len - plen + 1))
            stop = bool(rng.random() < 0.3)
            eng.add(next_id, prompt, max_tokens, stop)
            requests[next_id] = (prompt, max_tokens, stop)
            next_id += 1
        eng.propose()
        eng.step(budget, max_seqs)
        sched.check_invariants()
        steps += 1
        assert steps < 3000, "no progress: livelock"
    assert set(eng.finished) == set(requests)
    for sid, (prompt, max_tokens, stop) in requests.items():
        got = eng.tokens[sid][len(prompt):]
        assert got == expected_output(sid, prompt, max_tokens, stop, max_model_len), f"request {sid}"
    assert sched.num_free_blocks == num_blocks, "blocks leaked"


def test_decode_lookahead_reserves_the_next_block() -> None:
    """SchedulerConfig.decode_lookahead (async decode): after each decode step without drafts a
    request also holds the block of its next position (the step launched ahead writes there), when
    a block is free; with none free it runs on without it, and no request is preempted for it."""
    B = 4
    for blocks, lookahead in ((12, True), (12, False), (5, True)):
        sched = make_scheduler(max_num_seqs=1, max_num_batched_tokens=64, max_model_len=64, block_size=B,
                               num_kv_blocks=blocks, enable_prefix_caching=False, decode_lookahead=lookahead)
        eng = FakeEngine(sched, B, blocks, np.random.default_rng(0), 0, 0.0)
        eng.add(0, [1, 2, 3, 4, 5, 6, 7], 13, False)  # 7 + 13 = 20 positions: 5 blocks
        covered = []
        while sched.has_unfinished():
            eng.step(64, 1)
            if sched.has_unfinished():
                held = int((sched.block_tables(np.array([0]))[0] >= 0).sum())
                covered.append(held * B > sched.num_computed(0))  # the next position's block is held
        assert eng.tokens[0][7:] == expected_output(0, [1, 2, 3, 4, 5, 6, 7], 13, False, 64)
        assert sched.stats()["num_preemptions"] == 0
        if lookahead:
            assert all(covered), covered
        else:
            assert not all(covered), "without lookahead a step that fills its last block holds no next one"


def test_preemption_happens_and_loses_nothing() -> None:
    rng = np.random.default_rng(0)
    sched = make_scheduler(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64, block_size=4,
                           num_kv_blocks=20, num_spec_tokens=3, enable_prefix_caching=False)
    eng = FakeEngine(sched, 4, 20, rng, 3, 0.7)
    reqs = {}
    for sid in range(6):
        prompt = [int(t) for t in rng.integers(0, VOCAB - 1, size=10)]
        eng.add(sid, prompt, 40, False)
        reqs[sid] = prompt
    while sched.has_unfinished():
        eng.propose()
        eng.step(64, 8)
        sched.check_invariants()
    assert sched.stats()["num_preemptions"] > 0
    for sid, prompt in reqs.items():
        assert eng.tokens[sid][10:] == expected_output(sid, prompt, 40, False, 64)


def test_stop_inside_an_accepted_run_drops_the_rest() -> None:
    sched = make_scheduler(num_kv_blocks=32, block_size=4, num_spec_tokens=4, max_model_len=64)
    sched.add_request(0, [1, 2, 3], 10, stop_token_ids=[42])
    b = sched.schedule()
    sched.update(np.array([5], dtype=np.int32), b.num_logits.astype(np.int32))
    sched.set_draft_tokens(0, [6, 42, 7, 8])
    b = sched.schedule()
    assert list(b.input_ids) == [5, 6, 42, 7, 8]
    n, reason = sched.update(np.array([6, 42, 7, 9], dtype=np.int32), np.array([4], dtype=np.int32))
    assert n[0] == 2 and _C.FINISH_REASONS[reason[0]] == "stop"
    assert not sched.has_unfinished() and sched.num_free_blocks == 32


def test_max_tokens_inside_an_accepted_run() -> None:
    sched = make_scheduler(num_kv_blocks=32, block_size=4, num_spec_tokens=4, max_model_len=64)
    sched.add_request(0, [1, 2, 3], 3)
    b = sched.schedule()
    sched.update(np.array([5], dtype=np.int32), b.num_logits.astype(np.int32))
    sched.set_draft_tokens(0, [6, 7, 8, 9])  # trimmed: only 2 more tokens may be committed
    b = sched.schedule()
    assert b.num_draft_tokens[0] == 1
    n, reason = sched.update(np.array([6, 10], dtype=np.int32), np.array([2], dtype=np.int32))
    assert n[0] == 2 and _C.FINISH_REASONS[reason[0]] == "length"


def test_budget_trims_drafts_before_dropping_requests() -> None:
    sched = make_scheduler(num_kv_blocks=64, block_size=4, num_spec_tokens=4, max_num_batched_tokens=6)
    for sid in range(3):
        sched.add_request(sid, [1, 2], 10)
    for _ in range(2):  # prefill of 3 x 2 tokens fits the budget exactly
        b = sched.schedule()
        sched.update(np.full(int(b.num_logits.sum()), 3, dtype=np.int32), b.num_logits.astype(np.int32))
    for sid in range(3):
        sched.set_draft_tokens(sid, [4, 4, 4, 4])
    b = sched.schedule()
    assert b.num_rows == 3, "every decode row keeps its token"
    assert b.num_tokens == 6 and b.num_draft_tokens.sum() == 3


def test_admission_errors_fail_alone() -> None:
    sched = make_scheduler(max_model_len=32, num_kv_blocks=64, block_size=4)
    with pytest.raises(ValueError, match="exceeds max_model_len"):
        sched.add_request(0, list(range(30)), 5)
    with pytest.raises(ValueError, match="prompt is empty"):
        sched.add_request(1, [], 5)
    sched.add_request(2, [1, 2, 3], 2)  # the others still run
    b = sched.schedule()
    assert list(b.seq_ids) == [2]


def test_misuse_of_the_step_protocol() -> None:
    sched = make_scheduler(num_kv_blocks=8, block_size=4)
    sched.add_request(0, [1, 2], 4)
    with pytest.raises(ValueError, match="without a preceding schedule"):
        sched.update(np.array([], dtype=np.int32), np.array([], dtype=np.int32))
    b = sched.schedule()
    with pytest.raises(ValueError, match="twice"):
        sched.schedule()
    with pytest.raises(ValueError, match="prefill chunk commits 1"):
        sched.update(np.array([], dtype=np.int32), np.array([0], dtype=np.int32))
    sched.update(np.array([3], dtype=np.int32), b.num_logits.astype(np.int32))
    with pytest.raises(ValueError, match="exceed num_spec_tokens"):
        sched.set_draft_tokens(0, [1])
    with pytest.raises(ValueError, match="unknown request id 7"):
        sched.abort_request(7)


def test_draft_batch_in_any_order_reaches_the_right_requests() -> None:
    sched = make_scheduler(num_kv_blocks=64, block_size=4, num_spec_tokens=3, max_num_seqs=4)
    for sid in range(3):
        sched.add_request(sid, [1, 2], 10)
    b = sched.schedule()
    sched.update(np.full(3, 5, dtype=np.int32), b.num_logits.astype(np.int32))
    # out of running order, one request left out: each row gets exactly its own drafts
    sched.set_draft_tokens_batch(np.array([2, 0], dtype=np.int64), np.array([20, 21, 0], dtype=np.int32),
                                 np.array([2, 1], dtype=np.int32))
    b = sched.schedule()
    assert list(b.seq_ids) == [0, 1, 2] and list(b.num_draft_tokens) == [1, 0, 2]
    assert list(b.input_ids) == [5, 0, 5, 5, 20, 21]


def test_a_batch_held_by_python_is_never_refilled() -> None:
    """schedule() reuses a batch's arrays only once nothing references it any more."""
    sched = make_scheduler(num_kv_blocks=64, block_size=4, max_num_seqs=4)
    sched.add_request(0, [1, 2, 3], 12)
    held = sched.schedule()
    ids, tables = held.input_ids, held.block_tables
    expect_ids, expect_tables = ids.copy(), tables.copy()
    sched.update(np.array([5], dtype=np.int32), np.array([1], dtype=np.int32))
    for _ in range(6):  # batches dropped right away are refilled by later steps
        b = sched.schedule()
        sched.update(np.array([6], dtype=np.int32), np.ones(b.num_rows, dtype=np.int32))
        del b
    assert (held.input_ids == expect_ids).all() and (ids == expect_ids).all()
    assert (tables == expect_tables).all() and held.num_rows == 1
