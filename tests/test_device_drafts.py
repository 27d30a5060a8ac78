"""Drafts that stay on the device until the verify step is launched (spec_decode/device_drafts.py):
the scheduler holds placeholders, the forward's ids are patched, resolve() brings the values into
the scheduler's draft rows and the batch before verification. The end-to-end equality with plain
decoding is in test_eagle3 / test_mtp / test_head_graphs (every MTP and EAGLE-3 step goes this way)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pyengine import _C
from pyengine.spec_decode.device_drafts import PLACEHOLDER, DeviceDrafts


def scheduler_after_prefill(max_tokens: list[int]) -> _C.Scheduler:
    cfg = _C.SchedulerConfig()
    cfg.num_kv_blocks, cfg.block_size, cfg.num_spec_tokens, cfg.max_num_seqs = 64, 4, 3, 4
    sched = _C.Scheduler(cfg)
    for sid, m in enumerate(max_tokens):
        sched.add_request(sid, [1, 2], m)
    b = sched.schedule()
    sched.update(np.full(len(max_tokens), 5, dtype=np.int32), b.num_logits.astype(np.int32))
    return sched


def hold(sched: _C.Scheduler, drafts: DeviceDrafts, proposals: dict[int, list[int]]) -> None:
    """What MtpProposer does: values on the 'device', placeholders in the scheduler."""
    ids = np.array(list(proposals), dtype=np.int64)
    counts = np.array([len(v) for v in proposals.values()], dtype=np.int64)
    drafts.hold(ids, counts, torch.tensor([t for v in proposals.values() for t in v], dtype=torch.int64))
    sched.set_draft_tokens_batch(ids, np.full(int(counts.sum()), PLACEHOLDER, np.int32), counts.astype(np.int32))


@pytest.mark.parametrize("proposals", [{2: [20, 21], 0: [30]}, {0: [30], 2: [20, 21]}], ids=["any_order", "in_order"])
def test_patch_and_resolve_put_each_rows_drafts_in_place(proposals: dict[int, list[int]]) -> None:
    sched = scheduler_after_prefill([10, 10, 10])
    drafts = DeviceDrafts(torch.device("cpu"))
    hold(sched, drafts, proposals)  # request 1 without drafts; in order, the values need no gather
    b = sched.schedule()
    assert list(b.input_ids) == [5, PLACEHOLDER, 5, 5, PLACEHOLDER, PLACEHOLDER]
    index, ids = drafts.patch_for(b)
    forward_ids = torch.from_numpy(np.array(b.input_ids)).index_copy(0, index, ids)
    assert forward_ids.tolist() == [5, 30, 5, 5, 20, 21]
    drafts.resolve(sched, b)
    assert list(b.input_ids) == [5, 30, 5, 5, 20, 21]
    # update() checks accepted tokens against the resolved drafts
    result = sched.update(np.array([30, 7, 9, 20, 21, 8], dtype=np.int32), np.array([2, 1, 3], dtype=np.int32))
    assert list(result[0]) == [2, 1, 3]


def test_unresolved_placeholders_are_not_accepted() -> None:
    sched = scheduler_after_prefill([10])
    hold(sched, DeviceDrafts(torch.device("cpu")), {0: [30, 31]})
    sched.schedule()
    with pytest.raises(ValueError, match="differs from the draft"):
        sched.update(np.array([30, 31, 4], dtype=np.int32), np.array([3], dtype=np.int32))


def test_a_trimmed_row_takes_its_first_drafts() -> None:
    # 2 tokens left after the prefill's: a verify step commits at most 2, so one draft is useful
    sched = scheduler_after_prefill([3, 10])
    drafts = DeviceDrafts(torch.device("cpu"))
    hold(sched, drafts, {0: [40, 41, 42], 1: [50, 51]})
    b = sched.schedule()
    assert list(b.num_draft_tokens) == [1, 2]
    index, ids = drafts.patch_for(b)
    assert index.tolist() == [1, 3, 4] and ids.tolist() == [40, 50, 51]
    drafts.resolve(sched, b)
    assert list(b.input_ids) == [5, 40, 5, 50, 51]


def test_fill_drafts_refuses_a_batch_that_is_not_in_flight() -> None:
    sched = scheduler_after_prefill([10])
    with pytest.raises(ValueError, match="without a scheduled step"):
        b = sched.schedule()
        sched.update(np.array([6], dtype=np.int32), np.array([1], dtype=np.int32))
        sched.fill_drafts(b, np.zeros(0, dtype=np.int32))
    sched.set_draft_tokens(0, [7, 8])
    b = sched.schedule()
    with pytest.raises(ValueError, match="1 tokens for 2 drafts"):
        sched.fill_drafts(b, np.array([7], dtype=np.int32))
