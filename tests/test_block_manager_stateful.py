"""Randomised state-machine test of the C++ BlockManager.

A simulated KV store records which (position, token) every slot holds, exactly as a forward pass
would write it, so the checks below see what a model would read: prefix-cache hits must serve the
prompt's own tokens, hashed blocks must hold committed tokens only, and writes must never land in
a block another request holds.
"""
from __future__ import annotations

import math

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pyengine import _C

VOCAB = 5  # tiny vocabulary: shared prefixes (and prefix hits) are common


class Req:
    def __init__(self, alloc: _C.KVAllocation, tokens: list[int], num_computed: int, reserved: int) -> None:
        self.alloc = alloc  # its blocks
        self.tokens = tokens  # committed tokens
        self.num_computed = num_computed
        self.reserved = reserved  # furthest position end any step (or admission) covered


class BlockManagerMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(4, 40), block_size=st.sampled_from([1, 2, 3, 4, 16]),
                k=st.integers(0, 6), prefix=st.booleans())
    def setup(self, num_blocks: int, block_size: int, k: int, prefix: bool) -> None:
        self.B, self.k = block_size, k
        self.bm = _C.BlockManager(num_blocks, block_size, enable_prefix_caching=prefix)
        self.kv_pos = np.full(num_blocks * block_size, -1)
        self.kv_tok = np.full(num_blocks * block_size, -1)
        self.reqs: dict[int, Req] = {}
        self.next_id = 0

    # --- helpers -------------------------------------------------------------------------------
    def slot(self, rid: int, pos: int) -> int:
        table = self.reqs[rid].alloc.block_table
        return table[pos // self.B] * self.B + pos % self.B

    def write(self, rid: int, start: int, tokens: list[int]) -> None:
        for i, tok in enumerate(tokens):
            s = self.slot(rid, start + i)
            assert self.bm.ref_count(s // self.B) == 1, "a write landed in a shared block"
            self.kv_pos[s], self.kv_tok[s] = start + i, tok

    def step(self, rid: int, n_inputs: list[int], accepted: int, new_token: int) -> None:
        """A forward over n_inputs at [num_computed, ...), then commit `accepted` of them."""
        r = self.reqs[rid]
        n = len(n_inputs)
        if not self.bm.can_append(self.reqs[rid].alloc, r.num_computed, n):
            free = self.bm.num_free_blocks
            try:
                self.bm.append(self.reqs[rid].alloc, r.num_computed, n)
                raise AssertionError("append succeeded where can_append said no")
            except _C.NoFreeBlocksError:
                pass
            assert self.bm.num_free_blocks == free, "a failed append changed the pool"
            return
        self.bm.append(self.reqs[rid].alloc, r.num_computed, n)
        r.reserved = max(r.reserved, r.num_computed + n)
        self.write(rid, r.num_computed, n_inputs)
        r.num_computed += accepted
        return

    # --- rules -----------------------------------------------------------------------------------
    @rule(data=st.data(), length=st.integers(1, 24), lookahead=st.integers(0, 8))
    def allocate(self, data: st.DataObject, length: int, lookahead: int) -> None:
        tokens = data.draw(st.lists(st.integers(0, 1), min_size=length, max_size=length))
        rid = self.next_id
        self.next_id += 1
        alloc = _C.KVAllocation()
        if not self.bm.can_allocate(tokens, lookahead):
            free = self.bm.num_free_blocks
            try:
                self.bm.allocate(alloc, tokens, lookahead)
                raise AssertionError("allocate succeeded where can_allocate said no")
            except _C.NoFreeBlocksError:
                pass
            assert self.bm.num_free_blocks == free
            return
        cached = self.bm.allocate(alloc, tokens, lookahead)
        self.reqs[rid] = Req(alloc, tokens, cached, length + lookahead)
        assert cached % self.B == 0 and 0 <= cached < length, "a hit must leave the last token to compute"
        for p in range(cached):  # a prefix hit must serve exactly this prompt's KV
            s = self.slot(rid, p)
            assert (self.kv_pos[s], self.kv_tok[s]) == (p, tokens[p]), "prefix cache served wrong KV"

    @precondition(lambda self: any(r.num_computed < len(r.tokens) - 1 for r in self.reqs.values()))
    @rule(data=st.data())
    def prefill_chunk(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(i for i, r in self.reqs.items() if r.num_computed < len(r.tokens) - 1)))
        r = self.reqs[rid]
        chunk = data.draw(st.integers(1, len(r.tokens) - r.num_computed))
        inputs = r.tokens[r.num_computed:r.num_computed + chunk]
        before = r.num_computed
        self.step(rid, inputs, chunk, 0)
        if r.num_computed == len(r.tokens) and before != r.num_computed:
            r.tokens.append(data.draw(st.integers(0, VOCAB - 1)))  # the sampled token
        self.bm.cache_full_blocks(r.alloc, r.tokens, min(r.num_computed, len(r.tokens)))

    @precondition(lambda self: any(r.num_computed == len(r.tokens) - 1 for r in self.reqs.values()))
    @rule(data=st.data())
    def verify_step(self, data: st.DataObject) -> None:
        """Decode with d drafts (ragged, possibly 0), accept a random prefix, roll back the rest."""
        rid = data.draw(st.sampled_from(sorted(i for i, r in self.reqs.items() if r.num_computed == len(r.tokens) - 1)))
        r = self.reqs[rid]
        d = data.draw(st.integers(0, self.k))
        drafts = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=d, max_size=d))
        accepted = data.draw(st.integers(1, d + 1))
        before = r.num_computed
        self.step(rid, [r.tokens[-1]] + drafts, accepted, 0)
        if r.num_computed == before:
            return  # the step did not fit
        correction = data.draw(st.integers(0, VOCAB - 1))
        r.tokens.extend(drafts[:accepted - 1] + [correction])
        assert r.num_computed == len(r.tokens) - 1
        self.bm.cache_full_blocks(r.alloc, r.tokens, min(r.num_computed, len(r.tokens)))

    @precondition(lambda self: bool(self.reqs))
    @rule(data=st.data(), readmit=st.booleans())
    def free_or_preempt(self, data: st.DataObject, readmit: bool) -> None:
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        r = self.reqs.pop(rid)
        self.bm.free(r.alloc)
        try:
            self.bm.free(r.alloc)
            raise AssertionError("double free was accepted")
        except ValueError:
            pass
        if readmit and self.bm.can_allocate(r.tokens, 1):  # preemption by recompute
            alloc = _C.KVAllocation()
            cached = self.bm.allocate(alloc, r.tokens, 1)
            self.reqs[self.next_id] = Req(alloc, r.tokens, cached, len(r.tokens) + 1)
            self.next_id += 1

    # --- invariants --------------------------------------------------------------------------------
    @invariant()
    def pool_and_tables_agree(self) -> None:
        if not hasattr(self, "bm"):
            return
        self.bm.check_invariants([r.alloc for r in self.reqs.values()])  # C++: free lists, LRU, hash table consistency
        refs = np.zeros(self.bm.num_blocks, dtype=int)
        for rid, r in self.reqs.items():
            table = self.reqs[rid].alloc.block_table
            assert len(table) == math.ceil(r.reserved / self.B), "block table does not match the formula"
            refs[table] += 1
        used = int((refs > 0).sum())
        assert used + self.bm.num_free_blocks == self.bm.num_blocks
        for b in range(self.bm.num_blocks):
            assert self.bm.ref_count(b) == refs[b]
            if refs[b] > 1:
                assert self.bm.block_has_hash(b), "only prefix-cached blocks may be shared"

    @invariant()
    def hashed_blocks_hold_committed_tokens(self) -> None:
        if not hasattr(self, "bm"):
            return
        for b in self.bm.hashed_block_ids():
            s = slice(b * self.B, (b + 1) * self.B)
            assert list(self.kv_tok[s]) == self.bm.block_tokens(b), "hash entry tokens differ from the block's KV"
            assert list(self.kv_pos[s] % self.B) == list(range(self.B)) if self.B > 1 else True


BlockManagerMachine.TestCase.settings = settings(max_examples=120, stateful_step_count=40, deadline=None)
TestBlockManagerStateful = BlockManagerMachine.TestCase
