"""A drafting layer's drafts for verify steps built on the device (MTP, EAGLE-3; greedy rows): the
part of pyengine/engine/device_verify.py's loop that stands for the prompt lookup.

Step N (a greedy decode or verify step) has run; its argmax and the target's states of its tokens
are on the device, and the accept half of next_verify_step has written each row's accepted count
a. What MtpProposer.propose would do on the host for step N + 1, queued on the stream instead:
- catch-up: the layer over every token of step N, at its positions p0 .. p0 + d, each fed the
  argmax at its position as x_{p+1} and the target's state there. For p <= p0 + a the argmax is
  the token committed at p + 1 (the drafts kept, then the bonus), so those positions' entries are
  the host's catch-up's; the entries past p0 + a come from rejected tokens and are rewritten by the
  next catch-up before any draft reads them (a position's key is written before it is attended to),
  as the host's chained drafts' entries are. The shape is step N's, known on the host, so only the
  row whose output drafts depends on a: draft 1 comes from the layer's output at p0 + a.
- chain: draft 1, then drafts 2.. from position p0 + a + 1 on, in one replay (DraftChain.run_from_state:
  its positions shifted by a on the device; every such position lies in blocks the launch checked
  for the longest outcome).
The drafts come as [draft, row] (the chain's static output), which next_verify_step's second half
takes (each row its limit's worth, which the caps bound). A row's layer entries must be complete up to p0 first: the positions it deferred
(HiddenRing) are caught up on the host's usual path before (catch_up_held). When the step is used
(the scheduler's next batch is it), adopt() records what the layer now holds (MtpProposer.valid);
when it is discarded the host's propose() catches up and drafts as if nothing had been launched,
from a copy of the step's states (ModelRunner.hold_hidden: the launched replay overwrites them).
"""
from __future__ import annotations

import numpy as np
import torch

from pyengine.engine.host_arrays import to_device
from pyengine.spec_decode.head_graphs import HeadFeed


class LayerDeviceDrafts:
    def __init__(self, proposer) -> None:
        self.proposer = proposer
        self._feed: tuple | None = None  # (key, HeadFeed, chain steps) of the step being launched

    def prepare(self, scheduler, seq_ids: np.ndarray, first_positions: np.ndarray, num_drafts: np.ndarray,
                caps: np.ndarray, tables: np.ndarray) -> bool:
        """Can the layer draft on the device after this step (seq_ids: its rows; first_positions,
        num_drafts: each row's first position and drafts in it; caps: the most drafts each may get
        next)? The target's states of this step's tokens must be at hand, the rows known to the
        layer, and the catch-up and chain graphs capturable; then the rows' deferred positions are
        caught up (catch_up_held) and the graphs captured, so that draft() only queues work."""
        p = self.proposer
        graphs, rows_info = p.graphs, p.runner.last_rows
        if graphs is None or p.runner.last_hidden is None or rows_info is None:
            return False
        if not np.array_equal(rows_info[0], seq_ids) or not np.array_equal(rows_info[1], first_positions):
            return False
        if p.gone.intersection(seq_ids.tolist()):
            return False
        steps = int(caps.max(initial=0)) - 1
        if steps > 0 and (p.chain is None or not p.chain.fits(len(seq_ids), tables, steps)):
            return False
        feed = HeadFeed.build(tables, first_positions, num_drafts + 1, p.block_size)
        key = graphs.key_for(feed)
        if key is None or key[1] < 0:
            return False
        p.catch_up_held(scheduler, seq_ids, first_positions)
        p.runner.hold_hidden()
        # the host's drafts of this step were patched into it already; a step after a discarded
        # launch must not take them as its own (DeviceDrafts.patch_for)
        p.device_drafts.clear()
        if graphs.use_graphs and key not in graphs.graphs:
            graphs.graphs[key] = graphs._capture(key)
        if steps > 0:
            p.chain.prepare(len(seq_ids), steps)
        self._feed = (key, feed, steps)
        return True

    def draft(self, argmax: torch.Tensor, accepted: torch.Tensor, tables: np.ndarray, first_positions: np.ndarray,
              caps: np.ndarray) -> torch.Tensor:
        """Queue the catch-up and the chain for the prepared step (argmax: its argmax, one per
        token; accepted: each row's a, on the device) and return the drafts [1 + chain steps,
        rows] (row r's draft j at [j, r]; a static buffer the kernel's second half reads next)."""
        assert self._feed is not None, "prepare() first"
        (key, feed, steps), self._feed = self._feed, None
        p = self.proposer
        rows, n = len(first_positions), int(feed.query_start_loc[-1])
        hidden = p.runner.last_hidden[:n]
        out, _ = p.graphs.run(key, feed, p.target_hidden(hidden), argmax[:n])
        p.num_forwards += 1
        starts = to_device(feed.query_start_loc[:-1].astype(np.int64), p.device)
        after_bonus = starts + accepted[:rows]  # each row's state after its bonus token: draft 1's
        if steps == 0:
            return p.layer.compute_logits(out.index_select(0, after_bonus)).argmax(dim=-1)[None]
        chain = p.chain
        torch.index_select(out, 0, after_bonus, out=chain.first_hidden[:rows])
        p.num_forwards += steps
        return chain.run_from_state(tables, first_positions + 1, np.maximum(caps - 1, 0), accepted[:rows])

    def adopt(self, seq_ids: np.ndarray, first_positions: np.ndarray, accepted: np.ndarray) -> None:
        """The launched step is used, its predecessor's acceptance known: each row's layer entries
        now run through its bonus token's predecessor (first + a), as the host's catch-up leaves them."""
        self.proposer.caught_up(seq_ids, first_positions + accepted + 1)
