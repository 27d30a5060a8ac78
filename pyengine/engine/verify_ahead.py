"""Verify ahead: a greedy verify step launches the NEXT verify step before it has its own result.

With a proposer on the host (ngram, suffix) a row's next drafts depend on this step only through
the tokens it commits. Assume every row accepts all its drafts, then the token its proposer
expects after them (PredictingProposer.predict: the draft chain continued past the drafts in
flight); the next step follows: each row's predicted token and up to as many drafts as this
step's plan gave it, at the positions after this step's, in the blocks the scheduler reserved
(SchedulerConfig.decode_lookahead). It is launched on its graph before this step's wait, so the
GPU runs it while the host commits this step and schedules the next.

It is used only if this step commits exactly the predicted tokens (confirm), the next step's
decode rows are the same, the scheduler is handed the predicted drafts as those rows' drafts, and
its batch then equals the launched one (PendingStep.matches); otherwise it is discarded, as a
decode step launched ahead is (pyengine/engine/launch_ahead.py). Outputs do not change: a greedy
verify step commits the target's argmax continuation whatever the drafts, and a used step is the
step the scheduler asks for. Its K/V writes lie past every row's committed tokens, in blocks the
row holds alone, so a discarded one is overwritten before anything reads there.

A wrong prediction costs a replay that the real step queues behind; a right one hides the host's
part of a step. Launches go on while at least HIT_RATE of recent predictions held (decayed
counts; a prediction without a row's next token, or a step that could not be launched, counts as
failed: its host work was spent); below it, one chance in PROBE_EVERY still tries, to keep the
estimate current. Large batches, where every row's prediction must hold, soon stop trying. With
the draft-length policy a prediction is also made only where its acceptance estimates give it a
chance of at least MIN_CHANCE (on an H100 a used step saved ~0.6 ms and a discarded one cost
about as much, so at a 50% hit rate the two cancelled).

launch_committed is the same launch without the prediction: once a step's tokens are committed
(scheduler.update), the next step goes out with each row's last token and the proposer's drafts
over the updated tokens, before the host processes outputs and schedules (LLMEngine's
_launch_committed). It needs no confirmation, only the scheduler's match.
"""
from __future__ import annotations

import numpy as np

from pyengine.engine.host_arrays import draft_token_ids
from pyengine.engine.pending_step import PendingStep
from pyengine.spec_decode.proposer import PredictingProposer


class VerifyAhead:
    MIN_CHANCE = 0.6  # the draft-length policy's chance that the prediction holds, below which none is made
    HIT_RATE = 0.4
    PROBE_EVERY = 16
    DECAY = 0.9

    def __init__(self) -> None:
        self.tries = self.hits = 1.0  # decayed counts of checked predictions; optimistic start
        self.chances = 0  # chances passed up since the last launch (below HIT_RATE)
        self.num_launched = self.num_confirmed = self.num_used = 0  # num_used: counted by the engine
        self.num_committed_launches = 0  # steps launched from a step's committed tokens (launch_committed)

    def worth_trying(self, batch, policy=None) -> bool:
        """Predict the step after `batch`? policy: the draft-length policy (None: fixed lengths),
        whose acceptance estimates give the chance that every row accepts all its drafts and the
        token after them (P_i at position d_i, the last position's where d_i = k)."""
        if policy is not None:
            rows = batch.num_rows
            p = policy.acceptance(np.asarray(batch.request_slots[:rows], dtype=np.int64))
            d = np.minimum(np.asarray(batch.num_draft_tokens), p.shape[1] - 1)
            if float(np.prod(p[np.arange(rows), d])) < self.MIN_CHANCE:
                return False
        if self.hits >= self.HIT_RATE * self.tries:
            return True
        self.chances += 1
        if self.chances < self.PROBE_EVERY:
            return False
        self.chances = 0
        return True

    def launch(self, scheduler, proposer: PredictingProposer, graph_runner, batch,
               lengths: np.ndarray) -> PendingStep | None:
        """Predict and launch the step after `batch` (its rows all decode / verify rows, lengths:
        the most drafts this step's plan gave each row). None: nothing launched (a row the next
        step would not run, no prediction for a row, or no graph / block for the step)."""
        rows = batch.num_rows
        d = np.asarray(batch.num_draft_tokens, dtype=np.int32)
        left = np.asarray(batch.tokens_left, dtype=np.int64) - d - 1  # after all drafts and the next token
        if (left < 1).any():
            return None
        seq_ids = np.array(batch.seq_ids)
        drafts = draft_token_ids(batch).astype(np.int32)
        limit = np.minimum(np.asarray(lengths, dtype=np.int64), left - 1).astype(np.int32)
        pred, counts = proposer.predict(scheduler, seq_ids, drafts, d, limit)
        if (counts < 1).any():
            self._count(False)  # the prediction's cost, for nothing: a miss
            return None
        first = np.asarray(batch.context_lens, dtype=np.int64)  # each row's next position
        pending, take = self._launch_rows(scheduler, graph_runner, seq_ids, first, pred, counts)
        if pending is None:
            self._count(False)
            return None
        self.num_launched += 1
        # this step must commit each row's drafts and then its predicted token
        expected = np.empty(int(d.sum()) + rows, dtype=np.int32)
        is_end = np.zeros(len(expected), dtype=bool)
        is_end[np.cumsum(d + 1) - 1] = True  # each row's last token: the predicted one
        expected[is_end] = pred[:, 0]
        expected[~is_end] = drafts
        pending.expected = (expected, d + 1)
        take[:, 0] = False
        pending.drafts = (pred[take], (counts - 1).astype(np.int32))
        return pending

    def launch_committed(self, scheduler, proposer: PredictingProposer, graph_runner, batch, tokens: np.ndarray,
                         counts: np.ndarray, lengths: np.ndarray) -> PendingStep | None:
        """Launch the step after `batch` from what it committed (scheduler.update has taken `tokens`,
        `counts` per row): each row's last committed token, its next input, then up to lengths[i]
        drafts, the proposer's over the updated tokens. Nothing is predicted, so the step is used
        whenever the scheduler's next batch is these rows (PendingStep.matches): the host's commit,
        outputs and scheduling run while the GPU computes it. None: a row has no token left after
        its next one, or no graph / block holds the step."""
        rows = batch.num_rows
        left = np.asarray(batch.tokens_left, dtype=np.int64) - counts  # after this step's tokens
        if (left < 1).any():
            return None
        seq_ids = np.array(batch.seq_ids)
        limit = np.minimum(np.asarray(lengths, dtype=np.int64), left - 1)
        nothing = np.zeros(rows, dtype=np.int32)
        pred, found = proposer.predict(scheduler, seq_ids, nothing[:0], nothing, np.maximum(limit - 1, 0).astype(np.int32))
        num_drafts = np.minimum(found, limit)
        inputs = np.empty((rows, 1 + pred.shape[1]), dtype=np.int64)
        inputs[:, 0] = tokens[np.cumsum(counts) - 1]  # each row's last committed token
        inputs[:, 1:] = pred
        d = np.asarray(batch.num_draft_tokens, dtype=np.int64)
        first = np.asarray(batch.context_lens, dtype=np.int64) - 1 - d + counts  # that token's position
        pending, take = self._launch_rows(scheduler, graph_runner, seq_ids, first, inputs, 1 + num_drafts)
        if pending is None:
            return None
        self.num_committed_launches += 1
        take[:, 0] = False
        pending.drafts = (inputs[take].astype(np.int32), num_drafts.astype(np.int32))
        return pending

    @staticmethod
    def _launch_rows(scheduler, graph_runner, seq_ids: np.ndarray, first: np.ndarray, inputs: np.ndarray,
                     counts: np.ndarray) -> tuple[PendingStep | None, np.ndarray]:
        """Launch the decode / verify step whose row i feeds inputs[i, :counts[i]] from position
        first[i] on, in the blocks the rows' tables hold; and the mask of the inputs it took."""
        take = np.arange(inputs.shape[1])[None, :] < counts[:, None]
        pending = graph_runner.launch_verify(seq_ids, counts.astype(np.int32), inputs[take].astype(np.int64), first,
                                             scheduler.block_tables(seq_ids))
        return pending, take

    def confirm(self, pending: PendingStep, tokens: np.ndarray, counts: np.ndarray) -> bool:
        """Did the launching step commit what `pending` was predicted from (tokens and counts per
        row, as the sampler gives them)?"""
        expected, expected_counts = pending.expected
        ok = np.array_equal(counts, expected_counts) and np.array_equal(tokens, expected)
        self._count(ok)
        self.num_confirmed += ok
        return ok

    def _count(self, hit: bool) -> None:
        self.tries = self.DECAY * self.tries + 1.0
        self.hits = self.DECAY * self.hits + hit
