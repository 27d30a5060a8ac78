"""Checkpoint saves of Gated DeltaNet layers (prefix caching, issue 21): a verify step leaves a base
state and per-token records, so a save of the state after token t materialises base + records 1..t.
The scheduler names the source row's slots with each copy (ScheduledBatch.state_copy_slots), and
StateCache.apply_copies materialises Gated DeltaNet pools (DeltaRuleShapes) while Mamba2 pools keep
their slot copy."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from pyengine.engine.state_cache import DeltaRuleShapes, StateCache
from pyengine.ops.reference import gdn as ref
from tests.test_state_checkpoints import copies, one_request_block1, scheduler, step


def test_copies_name_the_source_rows_slots() -> None:
    s = one_request_block1(interval=1)  # every position a checkpoint position, k = 3
    s.set_draft_tokens(0, np.array([5, 6, 7], dtype=np.int32))
    row = step(s, [[5, 6, 7, 8]]).state_slots[0].tolist()  # inputs at 3..6: the states after tokens 0..3
    nxt = s.schedule()  # the saves ride on the next batch
    assert [r[:3] for r in copies(nxt)[0]] == [[row[t], row[0], t] for t in range(4)]
    assert np.asarray(nxt.state_copy_slots).tolist() == [row] * 4  # base row[0], records row[1..t]


def test_restores_name_the_checkpoint_then_pad() -> None:
    s = scheduler(k=2, interval=8)
    prompt = list(range(1, 20))
    s.add_request(0, prompt, 2)
    for _ in range(3):
        step(s, [[]] if s.num_computed(0) + 8 < 19 else [[7]])
    step(s, [[7]])
    s.add_request(1, prompt[:17] + [99, 98], 1)
    b = s.schedule()
    _, restores = copies(b)
    assert len(restores) == 1
    assert np.asarray(b.state_copy_slots)[int(b.num_state_saves):].tolist() == [[restores[0][0], -1, -1]]
    s.update(np.array([5], dtype=np.int32), np.array([1], dtype=np.int32))


def test_apply_copies_materialises_delta_rule_pools_and_copies_mamba_pools() -> None:
    hv, dv, dk, k = 2, 24, 16, 3
    gen = torch.Generator().manual_seed(0)
    shapes = [DeltaRuleShapes(((3 + k, 8), (hv, dv, dk))), None, ((3 + k, 8), (hv, dv, dk))]
    cache = StateCache(shapes, 8, torch.float32, torch.device("cpu"), num_spec_tokens=k, num_checkpoints=4)
    assert cache.records == [True, False, False]
    for pool in cache.ssm[0], cache.ssm[2]:
        pool.copy_(torch.randn(pool.shape, generator=gen))
    row = [5, 1, 6, 2]  # a verify row's slots: base, then token records
    x = {n: torch.randn(4, *s, generator=gen) for n, s in (("q", (1, dk)), ("k", (1, dk)), ("v", (hv, dv)))}
    g, beta = -torch.rand(4, hv, generator=gen), torch.rand(4, hv, generator=gen)
    qsl, idx, acc = torch.tensor([0, 4], dtype=torch.int32), torch.tensor([row], dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    ref.gated_delta_rule_update(x["q"], x["k"], x["v"], g, beta, cache.ssm[0], qsl, idx, acc)
    before = [p.clone() for p in cache.ssm if p is not None]
    # saves of the states after tokens 2 and 0 into checkpoints 8 and 9, then a restore of 8 into slot 3
    batch = SimpleNamespace(state_copies=np.array([[row[2], row[0], 2, 8], [row[0], row[0], 0, 9], [8, 8, 0, 3]],
                                                  dtype=np.int32),
                            state_copy_slots=np.array([row, row, [8, -1, -1, -1]], dtype=np.int32), num_state_saves=2)
    cache.apply_copies(batch)
    for t, dst in ((2, 8), (0, 9)):
        scratch = torch.cat([before[0], before[0][:1]])
        ref.gated_delta_rule_materialise(scratch, idx, torch.tensor([t + 1], dtype=torch.int32),
                                         torch.tensor([8 + 4], dtype=torch.int32))
        assert torch.equal(cache.ssm[0][dst], scratch[-1])
    assert not torch.equal(cache.ssm[0][8], before[0][row[2]])  # not the record slot's raw floats
    assert torch.equal(cache.ssm[0][3], cache.ssm[0][8])  # the restore: the checkpoint as it is
    assert torch.equal(cache.ssm[2][8], before[1][row[2]]) and torch.equal(cache.ssm[2][3], before[1][row[2]])
    untouched = [s for s in range(12) if s not in (3, 8, 9)]
    assert torch.equal(cache.ssm[0][untouched], before[0][untouched])
