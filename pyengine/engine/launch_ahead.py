"""Steps launched ahead: the GPU runs step N + 1 while the host commits step N (LLMEngine's
methods for it, a mixin of the engine: they read and set its state).

Async decode (CUDA graphs, greedy decode rows only; EngineConfig.async_decode=False turns it off): a step
whose rows are all greedy decode rows launches the NEXT step's graph before it waits for its own
tokens. That next step's inputs are predicted on the host (every row continues: positions and
context lengths + 1, the slot of the next position in the row's block table, whose block the
scheduler reserved a step early where the position starts one - SchedulerConfig.decode_lookahead;
a row whose table lacks it launches nothing) and its token ids come from this step's argmax on the
device, so the GPU runs step N + 1 while the host commits step N. The next step() still schedules
normally and uses the launched forward only if the scheduler's batch is exactly the predicted one
(same rows in the same order, same inputs, positions, slots, context lengths, and the same table
entries for each row's context - a block reserved past it is not read);
otherwise the forward is discarded and the step runs as usual (its own writes follow the discarded
one's on the stream). Outputs are therefore identical with or without it: a predicted step is the
step the scheduler asks for, computed by the same graph on the same inputs. A discarded step writes
K/V only at the next position of its rows, in blocks those rows hold alone and that carry no hash
(the position is not yet computed), so nothing any request can read is touched (a block freed
since is rewritten by its next owner after, in stream order). Sampled
(non-greedy) rows, recurrent-state models, steps with prefill rows and steps after which a waiting
request could be admitted (a free sequence slot) never launch ahead.

Under speculation a step launches ahead only with the draft-length policy, when it plans no drafts
for the next step, or only for rows whose proposers have seldom found any lately (_plan_next): the
plan for step N + 1 is made while step N's tokens are on their way, from the policy state the next
step would see (a step without drafts teaches the policy only that its rows found none, shown to it
first), and the next step proposes with that plan. Proposers that read the target's hidden states
(MTP, EAGLE-3) get a copy of this step's (ModelRunner.hold_hidden: the launched replay overwrites
the graphs' buffers), and a launched step that is used leaves its own (adopt_launched).

A greedy verify step launches the next verify step ahead. With the device loop
(pyengine/engine/device_verify.py: ngram, suffix, MTP and EAGLE-3 up to 16 rows) it is built on
the device from this step's argmax and needs no prediction; it is also where a
decode step whose next step plans drafts sends it (_may_launch_next). Otherwise, with a proposer
on the host (ngram, suffix), its tokens and drafts are predicted as if every row accepts all its
drafts (verify ahead, pyengine/engine/verify_ahead.py). Either way the next step proposes nothing and takes the launched
step's drafts (a predicted step's only when this step committed the predicted tokens), and the
scheduler's batch must again be exactly the launched one. Where nothing was launched ahead (or the
prediction failed), a greedy step with such a proposer launches the next step as soon as its
tokens are committed (_launch_committed: its last tokens and the proposer's drafts over them, with
the plan the next step would make), before the outputs are processed and the next batch
scheduled; the same match decides whether it is used.
"""
from __future__ import annotations

import numpy as np
import torch

from pyengine.engine.device_verify import DeviceLaunch


class LaunchAhead:
    """LLMEngine's launch-ahead steps (module docstring); the engine owns every attribute they use."""

    def _sample_greedy(self, batch, logits: torch.Tensor,
                       key: tuple[int, int] | None) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """Argmax per row (the tokens the rejection sampler gives these rows), and first_bad as
        _sample gives it (None: every row finite, else 0 for a row with NaN / inf logits, -1 for
        the others), through GreedySampler.start; the next step's forward is launched before the
        wait for the host copies where it can be (module docstring)."""
        tok, host, fin_host, ready = self.greedy.start(logits)
        launched = None
        if key is not None and key[1] > 1:  # a verify graph ran this step (its drafts found none):
            key = (key[0], 1)  # the next decode step replays the decode graph
        if key is not None and self._may_launch_next(batch, key):
            tables = self.scheduler.block_tables(batch.seq_ids) if self.decode_lookahead else None
            self.runner.hold_hidden()  # the proposer reads this step's hidden states next step
            self._pending = self.runner.graph_runner.launch_next(batch, key, tok, tables)
        elif key is not None:
            launched = self._launch_verify(batch, tok)
        if ready is not None:
            ready.synchronize()
        tokens = host.numpy().astype(np.int32)  # a copy: the pinned buffer is reused next step
        if self._pending is not None and self._pending.input_ids is None:  # launch_next's
            self._pending.input_ids = tokens.astype(np.int64)
        finite = fin_host.numpy()
        first_bad = None if finite.all() else np.where(finite, -1, 0).astype(np.int64)
        counts = np.ones(batch.num_rows, dtype=np.int32)
        if launched is not None and first_bad is None:
            self._pending = self.device_verify.resolve(launched, tokens, counts)
        return tokens, counts, first_bad

    def _verify_greedy(self, batch, logits: torch.Tensor,
                       key: tuple[int, int] | None) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """GreedySampler.verify, with the next verify step launched ahead between its start and its
        wait where it may be (verify ahead, module docstring)."""
        tok, *started = self.greedy.start(logits)
        launched = self._launch_verify(batch, tok) if key is not None else None
        tokens, counts, first_bad = self.greedy.accept(batch, *started)
        if launched is not None and first_bad is None:
            self._pending = self.device_verify.resolve(launched, tokens, counts)
        return tokens, counts, first_bad

    def _launch_verify(self, batch, argmax: torch.Tensor) -> DeviceLaunch | None:
        """Launch the next verify step now, where _may_launch_ahead allows it and the next step
        drafts: a verify step's rows again as this step's plan said (_lengths), a decode step's as
        planned for the next step (_plan_next, which ran when it asked to launch a decode step and
        found drafts planned). With the device loop (ngram, suffix, MTP, EAGLE-3; steps within its
        row limit) it is built on the device from this step's argmax and returned, for resolve()
        once the tokens are read; else (ngram, suffix) it is predicted (verify ahead) where
        VerifyAhead.worth_trying agrees."""
        if (self.verify_ahead is None and self.device_verify is None) or not self._may_launch_ahead(batch):
            return None
        plan = self._lengths if batch.num_draft_tokens.any() else self._next_plan
        if plan is None or not np.array_equal(plan[0], batch.seq_ids) or not plan[1].any():
            return None
        if self.device_verify is not None and self.device_verify.takes(batch):
            launched = self.device_verify.launch(self.scheduler, batch, argmax, plan[1])
            if launched is not None:
                self._lengths = plan  # the launched step drafts as planned
            return launched
        if self.verify_ahead is not None and self.verify_ahead.worth_trying(batch, self.draft_length):
            self._lengths = plan
            self._pending = self.verify_ahead.launch(self.scheduler, self.proposer, self.runner.graph_runner, batch,
                                                    plan[1])
        return None

    def _launch_committed(self, batch, tokens: np.ndarray, counts: np.ndarray) -> None:
        """After this step's commit (scheduler.update), where no step is launched yet: launch the
        next one from the committed tokens (VerifyAhead.launch_committed; a proposer on the host),
        with the plan the next step would make (_next_plan if _plan_next made it, else made here:
        this step shown to the policy first, as the end of the step would). The host then commits,
        outputs and schedules while the GPU runs it; the next step uses it if its batch is the
        launched one. Not after a step with a finished row (it leaves the batch)."""
        if self.verify_ahead is None or self.runner.last_graph_key is None or not self._may_launch_ahead(batch):
            return
        seq_ids = np.asarray(batch.seq_ids)
        plan = self._next_plan
        if plan is None or not np.array_equal(plan[0], seq_ids):
            view = self.scheduler.decode_view()  # after this step's commit
            if not np.array_equal(view.seq_ids, seq_ids):
                return
            if self.draft_length is None:
                plan = (seq_ids.copy(), np.full(batch.num_rows, self.k, dtype=np.int32))
            else:
                self._plan_after(batch, counts, view)
                plan = self._next_plan
        pending = self.verify_ahead.launch_committed(self.scheduler, self.proposer, self.runner.graph_runner, batch,
                                                     tokens, counts, plan[1])
        if pending is not None:
            self._pending, self._lengths = pending, plan

    def _may_launch_ahead(self, batch) -> bool:
        """What every step launched ahead needs: async decode on graphs without recurrent state,
        no recorded logits or logprobs (they read this step's logits after sampling: the next
        replay would overwrite them), only decode / verify rows, and no request that can be
        admitted (a waiting request is admitted only into a free sequence slot)."""
        g = self.runner.graph_runner
        if (not self.async_decode or self.cfg.record_logits or self.num_logprob_requests
                or g is None or g.state_cache is not None or batch.num_decode_rows != batch.num_rows):
            return False
        return not (self.scheduler.num_waiting and self.scheduler.num_running < self.cfg.max_num_seqs)

    def _may_launch_next(self, batch, key: tuple[int, int]) -> bool:
        """Launch the next decode step now? Only where it is likely to be the step the scheduler
        asks for: a graph step of decode rows only (q = 1), no recurrent state, no request that can
        be admitted (none waits, or every sequence slot is taken), no row that this step's token
        finishes by length, and under speculation a plan without drafts for the next step (_plan_next)."""
        if not self._may_launch_ahead(batch) or (self.proposer is not None and self.draft_length is None):
            return False
        if key[1] != 1:
            return False
        # this step's token is a row's last one when it has one token left
        if not (batch.tokens_left > 1).all():
            return False
        if self.proposer is None:
            return True
        quiet = self._plan_next(batch)
        # the device loop builds a planned verify step (_launch_verify) whether or not its rows then
        # find drafts, at about a decode step's cost: no need to bet on none being found
        loop = self.device_verify
        return quiet and (loop is None or not loop.takes(batch) or not self._next_plan[1].any())

    def _plan_next(self, batch) -> bool:
        """Speculation: plan the next step's drafts now, for this step's rows (all decode rows
        without drafts, all continuing); True when it most likely gives no row drafts (none
        planned, or for rows that seldom find any: DraftLengthPolicy.expects_no_drafts), so the
        next step may be launched ahead; a row that does find drafts discards it. This step is
        shown to the policy first (as the end of the step would); the next _propose uses the plan
        if its rows are these."""
        # which rows can finish last, from the running requests as they stand before this commit
        # (every row commits one token, so the comparison is the same after it)
        self._plan_after(batch, np.ones(batch.num_rows, dtype=np.int32), self.scheduler.decode_view())
        return self.draft_length.expects_no_drafts()

    def _plan_after(self, batch, counts: np.ndarray, view) -> None:
        """The next step's plan for this step's rows, made now (_plan_next, _launch_committed) into
        _next_plan, which the next _propose uses if its rows are these: this step (counts: the
        tokens each row commits) shown to the policy first, as the end of the step would; view:
        the scheduler's decode view, for which rows can finish last."""
        rows = batch.num_rows
        slots, seq_ids = np.array(batch.request_slots[:rows]), np.array(batch.seq_ids[:rows])
        if not self._observed:
            self.draft_length.observe_rows(slots, batch.num_draft_tokens[:rows], counts)
            self._observed = True
        last = self._can_finish_last(view) if np.array_equal(view.seq_ids, seq_ids) else None
        self._next_plan = (seq_ids, self.draft_length.draft_lengths(slots, seq_ids, last))
