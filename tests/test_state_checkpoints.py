"""The scheduler's recurrent-state checkpoints (prefix caching of hybrid models), driven directly:
which copies each batch carries (ScheduledBatch.state_copies), where prefill chunks end, which
prefix hits a hybrid request gets, and the pool's LRU eviction."""
from __future__ import annotations

import numpy as np

from pyengine import _C

B = 4  # block size; checkpoints every block unless a test says otherwise


def scheduler(k: int = 0, num_checkpoints: int = 8, interval: int = B, budget: int = 64) -> _C.Scheduler:
    c = _C.SchedulerConfig()
    c.max_num_seqs, c.max_num_batched_tokens, c.max_model_len = 4, budget, 128
    c.block_size, c.num_kv_blocks, c.enable_prefix_caching = B, 64, True
    c.num_spec_tokens, c.num_state_slots = k, 4 * (1 + k)
    c.num_state_checkpoints, c.state_checkpoint_interval = num_checkpoints, interval
    return _C.Scheduler(c)


def copies(batch) -> tuple[list[list[int]], list[list[int]]]:
    """(saves, restores) of a batch, as rows [ssm slot, conv line, conv offset, destination]."""
    rows = np.asarray(batch.state_copies).tolist()
    return rows[:batch.num_state_saves], rows[batch.num_state_saves:]


def step(s: _C.Scheduler, tokens_per_row: list[list[int]]):
    """schedule + update committing the given tokens per row; returns the batch."""
    b = s.schedule()
    flat = [t for row in tokens_per_row for t in row]
    s.update(np.array(flat, dtype=np.int32), np.array([len(r) for r in tokens_per_row], dtype=np.int32))
    s.check_invariants()
    return b


def run_to_end(s: _C.Scheduler, batch=None) -> None:
    """Commit token 5 for every logit row until every request finished (batch: one already scheduled)."""
    while batch is not None or s.has_unfinished():
        b = batch if batch is not None else s.schedule()
        batch = None
        n = np.asarray(b.num_logits, dtype=np.int32)
        s.update(np.full(int(n.sum()), 5, dtype=np.int32), np.minimum(n, 1))


def test_prefill_chunks_end_at_checkpoint_positions_and_save_their_state() -> None:
    s = scheduler(interval=8)  # 4 running slots (k = 0): checkpoint slots are 4, 5, ...
    s.add_request(0, list(range(1, 20)), 4)  # 19 tokens: chunks [0, 8), [8, 16), [16, 19)
    b1 = step(s, [[]])
    assert list(np.diff(b1.query_start_loc)) == [8]
    slot0 = int(b1.state_slots[0, 0])
    b2 = step(s, [[]])
    assert copies(b2) == ([[slot0, slot0, 0, 4]], [])  # the state at 8, saved before the next forward
    b3 = step(s, [[7]])  # the last chunk, 3 tokens: its end (19) is no checkpoint position
    assert list(np.diff(b3.query_start_loc)) == [3]
    assert copies(b3) == ([[slot0, slot0, 0, 5]], [])  # the state at 16
    assert copies(step(s, [[7]])) == ([], [])


def test_verify_rows_save_each_reached_position_from_its_token_slot() -> None:
    s = scheduler(k=3)  # 16 running slots: checkpoint slots are 16, 17, ...
    s.add_request(0, [1, 2, 3, 4, 5, 6], 20)  # chunks [0, 4) (state at 4 -> slot 16) and [4, 6)
    step(s, [[]])
    step(s, [[9]])
    s.set_draft_tokens(0, np.array([10, 11, 12], dtype=np.int32))
    b = step(s, [[10, 11, 12, 13]])  # inputs at 6..9, all accepted: position 8 is reached
    slots = b.state_slots[0].tolist()
    saves, _ = copies(step(s, [[14]]))
    # the state at 8 is the one after the input at 7: token t = 1 of the row, slot 1, conv offset 1
    assert saves == [[slots[1], slots[0], 1, 17]]


def one_request_block1(interval: int) -> _C.Scheduler:
    c = _C.SchedulerConfig()
    c.max_num_seqs, c.max_num_batched_tokens, c.max_model_len, c.block_size = 2, 64, 64, 1
    c.num_kv_blocks, c.num_spec_tokens, c.num_state_slots = 64, 3, 8
    c.num_state_checkpoints, c.state_checkpoint_interval = 16, interval
    s = _C.Scheduler(c)
    s.add_request(0, [1, 2, 3], 30)
    while s.num_computed(0) < 3:  # prefill chunks end at every checkpoint position
        step(s, [[9]] if s.num_computed(0) + interval >= 3 else [[]])
    assert s.token_ids(0) == [1, 2, 3, 9]
    return s


def verify(s: _C.Scheduler, drafts: list[int], committed: list[int]) -> tuple[list[int], list[list[int]]]:
    """A verify step, then the next step: (the verify row's slots, the saves the verify queued)."""
    s.set_draft_tokens(0, np.array(drafts, dtype=np.int32))
    slots = step(s, [committed]).state_slots[0].tolist()
    return slots, copies(s.schedule())[0]


def test_acceptance_stopping_below_a_position_saves_nothing_and_a_later_step_saves_it() -> None:
    s = one_request_block1(interval=4)
    s.set_draft_tokens(0, np.array([5, 6, 7], dtype=np.int32))
    step(s, [[5, 8]])  # inputs at 3..6, one draft accepted: computed 3 -> 5 (4 reached, t = 0)
    s.set_draft_tokens(0, np.array([1, 2, 3], dtype=np.int32))
    b = s.schedule()  # inputs at 5..8: the drafts reach 8, but only the bonus is committed: 5 -> 6
    assert [r[:3] for r in copies(b)[0]] == [[int(b.state_slots[0, 0])] * 2 + [0]]  # the state at 4
    s.update(np.array([4], dtype=np.int32), np.array([1], dtype=np.int32))
    slots, saves = verify(s, [2, 2, 2], [2, 2, 9])  # inputs at 6..9, two accepted: 6 -> 9
    assert s.num_computed(0) == 9
    # nothing was saved from the step that stopped below 8; the state at 8 is the one after the
    # input at 7 of the later step: its token t = 1, not the running block's last state
    assert [r[:3] for r in saves] == [[slots[1], slots[0], 1]]


def test_several_positions_in_one_step_and_acceptance_ending_exactly_on_one() -> None:
    s = one_request_block1(interval=1)  # block size 1: every position is a checkpoint position
    slots, saves = verify(s, [5, 6, 7], [5, 6, 7, 8])  # inputs at 3..6: positions 4, 5, 6, 7
    assert [r[:3] for r in saves] == [[slots[t], slots[0], t] for t in range(4)]
    assert len({r[3] for r in saves}) == 4  # four checkpoints
    s.update(np.array([5], dtype=np.int32), np.array([1], dtype=np.int32))
    s2 = one_request_block1(interval=2)
    slots, saves = verify(s2, [5, 6, 7], [5, 8])  # inputs at 3..6, computed 3 -> 5: 4 reached (t = 0)
    assert [r[:3] for r in saves] == [[slots[0], slots[0], 0]]
    s2.update(np.array([5], dtype=np.int32), np.array([1], dtype=np.int32))  # computed 5 -> 6: ends on 6
    assert [r[:3] for r in copies(s2.schedule())[0]] == [[slots[0], slots[0], 0]]


def test_a_hit_restores_the_last_checkpointed_block_and_never_covers_the_last_token() -> None:
    s = scheduler(interval=8)
    prompt = list(range(1, 20))
    s.add_request(0, prompt, 2)
    for _ in range(3):  # chunks [0, 8), [8, 16), [16, 19): checkpoints at 8 (slot 4) and 16 (slot 5)
        step(s, [[]] if s.num_computed(0) + 8 < 19 else [[7]])
    step(s, [[7]])  # finishes (max_tokens 2); its blocks stay cached, with their checkpoints
    assert s.num_running == 0
    s.add_request(1, prompt[:17] + [99, 98], 1)  # shares 17 tokens: the hit ends at 16
    b = s.schedule()
    assert int(b.num_computed[0]) == 16
    assert copies(b) == ([], [[5, 5, 0, int(b.state_slots[0, 0])]])
    s.update(np.array([5], dtype=np.int32), np.array([1], dtype=np.int32))
    s.add_request(2, prompt[:16], 1)  # 16 tokens: a hit covers at most 15, and 12 has no checkpoint
    b = s.schedule()
    assert int(b.num_computed[0]) == 8 and copies(b)[1][0][0] == 4
    s.update(np.array([5], dtype=np.int32), np.array([1], dtype=np.int32))
    assert s.stats()["num_state_restores"] == 2


def test_a_full_pool_evicts_the_oldest_checkpoint_and_a_hit_needs_one() -> None:
    s = scheduler(interval=4, num_checkpoints=1)
    prompt = list(range(1, 14))  # 13 tokens: chunks end at 4, 8, 12, 13
    s.add_request(0, prompt, 1)
    for _ in range(4):
        step(s, [[]] if s.num_computed(0) < 12 else [[7]])
    assert s.num_used_state_checkpoints == 1  # the one slot holds the newest state: the one at 12
    s.add_request(1, prompt[:9] + [50], 1)  # its KV blocks hit up to 8, but 4's and 8's states are gone
    b = s.schedule()
    assert int(b.num_computed[0]) == 0 and copies(b) == ([], [])
    run_to_end(s, b)  # it recomputes 4 and 8: the one slot now holds the state at 8 (12's is evicted)
    s.add_request(2, prompt[:12] + [60], 1)  # its KV blocks hit up to 12; the newest state is at 8
    b = s.schedule()
    assert int(b.num_computed[0]) == 8 and copies(b)[1] == [[4, 4, 0, int(b.state_slots[0, 0])]]
    run_to_end(s, b)
    s.check_invariants()
