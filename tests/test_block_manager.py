"""Named regression cases for the BlockManager: each is a bug shape another engine shipped."""
from __future__ import annotations

import pytest

from pyengine import _C


class Allocations(dict):
    """Request id -> its KVAllocation (the engine keeps one per Sequence), made on first use."""

    def __missing__(self, rid: int) -> _C.KVAllocation:
        self[rid] = alloc = _C.KVAllocation()
        return alloc

    def live(self) -> list[_C.KVAllocation]:
        return [a for a in self.values() if a.allocated]


A = Allocations()


@pytest.fixture(autouse=True)
def fresh_allocations() -> None:
    A.clear()


def computed(bm: _C.BlockManager, rid: int, tokens: list[int], num_computed: int) -> None:
    bm.cache_full_blocks(A[rid], tokens, min(num_computed, len(tokens)))


def test_append_at_block_boundary_takes_one_new_block() -> None:
    bm = _C.BlockManager(num_blocks=8, block_size=4)
    bm.allocate(A[0], [1, 2, 3, 4])  # exactly one full block, no lookahead
    assert len(A[0].block_table) == 1
    assert bm.blocks_needed(A[0], 4 + 1) == 1  # position 4 starts block 1
    bm.append(A[0], num_computed=4, n=1)
    assert len(A[0].block_table) == 2


def test_k_at_least_block_size_crosses_several_boundaries() -> None:
    # ATOM PR 250 seed: a check of "one new block at most" under-allocates k+1 tokens.
    bm = _C.BlockManager(num_blocks=16, block_size=2)
    bm.allocate(A[0], [1, 2, 3])  # 2 blocks
    assert bm.blocks_needed(A[0], 3 + 6) == 3  # positions 3..8 with k = 5 drafts
    bm.append(A[0], num_computed=3, n=6)
    assert len(A[0].block_table) == 5


def test_block_size_one_with_several_tokens() -> None:
    bm = _C.BlockManager(num_blocks=10, block_size=1)
    bm.allocate(A[0], [7])
    bm.append(A[0], num_computed=1, n=4)
    table = A[0].block_table
    assert len(table) == 5 and len(set(table)) == 5


def test_exact_fit_and_one_block_short() -> None:
    bm = _C.BlockManager(num_blocks=4, block_size=4)
    bm.allocate(A[0], [1] * 4)  # 1 block used, 3 free
    assert bm.can_append(A[0], 4, 12)  # needs exactly 3
    assert not bm.can_append(A[0], 4, 13)  # needs 4: one short
    free = bm.num_free_blocks
    with pytest.raises(_C.NoFreeBlocksError):
        bm.append(A[0], 4, 13)
    assert bm.num_free_blocks == free and len(A[0].block_table) == 1, "a failed append must change nothing"
    bm.append(A[0], 4, 12)
    assert bm.num_free_blocks == 0
    bm.check_invariants(A.live())


def test_can_allocate_counts_the_lookahead() -> None:
    bm = _C.BlockManager(num_blocks=3, block_size=4)
    prompt = list(range(12))  # 3 blocks: fits alone, not with a lookahead of 1
    assert bm.can_allocate(prompt, lookahead=0)
    assert not bm.can_allocate(prompt, lookahead=1)
    with pytest.raises(_C.NoFreeBlocksError):
        bm.allocate(A[0], prompt, lookahead=1)
    assert bm.num_free_blocks == 3


def test_can_allocate_has_no_side_effects() -> None:
    bm = _C.BlockManager(num_blocks=4, block_size=2)
    bm.allocate(A[0], [1, 2, 3, 4, 5])
    computed(bm, 0, [1, 2, 3, 4, 5], 5)
    bm.free(A[0])
    before = (bm.num_free_blocks, bm.hashed_block_ids())
    for _ in range(3):
        assert bm.can_allocate([1, 2, 3, 4, 9], lookahead=2)
    assert (bm.num_free_blocks, bm.hashed_block_ids()) == before


def test_rejected_tokens_are_never_hashed() -> None:
    bm = _C.BlockManager(num_blocks=8, block_size=4)
    tokens = [1, 2, 3]
    bm.allocate(A[0], tokens, lookahead=4)
    computed(bm, 0, tokens, 2)  # prefill of [1, 2] ... nothing full yet
    # verify step at positions 2..5 with drafts [8, 9, 9]: block 0 = [1, 2, 3, 8] fills with a draft
    bm.append(A[0], num_computed=2, n=4)
    # only the input token (3) is committed plus the correction 5; drafts rejected
    tokens = [1, 2, 3, 5]
    computed(bm, 0, tokens, 3)  # num_computed = 2 + 1
    assert bm.hashed_block_ids() == [], "block 0 holds a rejected draft at position 3"
    # the next step overwrites position 3 with the committed token, and only then hashes it
    bm.append(A[0], num_computed=3, n=1)
    tokens = tokens + [6]
    computed(bm, 0, tokens, 4)
    (b,) = bm.hashed_block_ids()
    assert bm.block_tokens(b) == [1, 2, 3, 5]


def test_a_multi_token_step_hashes_every_block_it_filled() -> None:
    bm = _C.BlockManager(num_blocks=8, block_size=2)
    tokens = [1, 2]
    bm.allocate(A[0], tokens, lookahead=7)
    tokens = [1, 2, 3, 4, 5, 6, 7, 8]  # a step accepted a long run: blocks 0..3 full at once
    computed(bm, 0, tokens, 7)
    assert len(bm.hashed_block_ids()) == 3  # positions < 7 are computed: blocks 0, 1, 2


def test_free_pool_hit_keeps_its_hash_and_consumes_capacity() -> None:
    bm = _C.BlockManager(num_blocks=6, block_size=4)
    prompt = list(range(9))
    bm.allocate(A[0], prompt)
    computed(bm, 0, prompt, 9)
    bm.free(A[0])
    hashed = bm.hashed_block_ids()
    assert len(hashed) == 2 and bm.num_free_blocks == 6
    cached = bm.allocate(A[1], prompt + [99])
    assert cached == 8
    assert A[1].block_table[:2] == sorted(hashed) or set(A[1].block_table[:2]) == set(hashed)
    assert all(bm.block_has_hash(b) for b in hashed), "claiming a free cached block dropped its hash"
    assert bm.num_free_blocks == 6 - 3, "a hit on a free block must consume free capacity"
    bm.check_invariants(A.live())


def test_whole_prompt_hit_still_recomputes_the_last_token() -> None:
    bm = _C.BlockManager(num_blocks=8, block_size=4)
    prompt = list(range(8))  # exactly two full blocks
    bm.allocate(A[0], prompt)
    computed(bm, 0, prompt, 8)
    cached = bm.allocate(A[1], prompt)
    assert cached == 4, "the last prompt token must be recomputed (and written to a private block)"
    shared, private = A[1].block_table[0], A[1].block_table[1]
    assert bm.ref_count(shared) == 2 and bm.ref_count(private) == 1


def test_lru_evicts_the_least_recently_freed_cached_block() -> None:
    bm = _C.BlockManager(num_blocks=3, block_size=2)
    for rid, prompt in enumerate([[1, 1], [2, 2], [3, 3]]):
        bm.allocate(A[rid], prompt, lookahead=0)
        computed(bm, rid, prompt, 2)
    first = A[0].block_table[0]
    for rid in range(3):
        bm.free(A[rid])
    bm.allocate(A[9], [5, 6])  # needs one block: evicts request 0's block, the oldest
    assert A[9].block_table == [first] and not bm.block_has_hash(first)
    assert bm.allocate(A[10], [2, 2, 7]) == 2, "the newer cached blocks survive"


def test_cache_salt_separates_prefixes() -> None:
    bm = _C.BlockManager(num_blocks=8, block_size=2)
    prompt = [1, 2, 3]
    bm.allocate(A[0], prompt, cache_salt=1)
    computed(bm, 0, prompt, 3)
    assert bm.allocate(A[1], prompt, cache_salt=2) == 0
    assert bm.allocate(A[2], prompt, cache_salt=1) == 2


def test_state_slots_admission_charges_both_pools() -> None:
    bm = _C.BlockManager(num_blocks=100, block_size=4, num_state_slots=8, state_slots_per_seq=4)
    bm.allocate(A[0], [1, 2])
    bm.allocate(A[1], [1, 2])
    assert len(set(A[0].state_slots) | set(A[1].state_slots)) == 8
    assert not bm.can_allocate([3], lookahead=0), "blocks are free but state slots are not"
    bm.free(A[0])
    assert bm.can_allocate([3]) and bm.num_free_state_slots == 4


def test_misuse_raises_clear_errors() -> None:
    bm = _C.BlockManager(num_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="holds no blocks"):
        bm.append(A[5], 0, 1)
    bm.allocate(A[0], [1])
    with pytest.raises(ValueError, match="already holds blocks"):
        bm.allocate(A[0], [1])
    bm.free(A[0])
    with pytest.raises(ValueError, match="double free"):
        bm.free(A[0])
    with pytest.raises(ValueError, match="block_size must be positive"):
        _C.BlockManager(num_blocks=4, block_size=0)
    with pytest.raises(ValueError, match="empty prompt"):
        bm.allocate(A[1], [])
    with pytest.raises(_C.NoFreeBlocksError):
        bm.allocate(A[2], list(range(17)))
