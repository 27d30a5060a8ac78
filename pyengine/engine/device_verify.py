"""Verify steps launched from the device (ngram and suffix speculation, greedy rows).

Verify ahead (verify_ahead.py) launches the next verify step before a step's tokens are known by
predicting them, and every row's prediction must hold; the step launched from committed tokens
waits for them. Here the next step is built on the GPU from the step's own argmax instead, so it
is never a guess: one kernel (hipkernels/spec/next_verify_step.h; on CPU tensors its reference)
accepts each row's drafts as the greedy rule does, appends the tokens kept to the request's
token history on the device, drafts, and writes the next step's ids, positions, slots, context
lengths and query starts into the graph's static buffer, which is then replayed. The drafts:
- ngram: the host proposer's prompt lookup, run over the history;
- suffix: the suffix proposer's prediction (made on the host before the wait, as verify ahead
  makes it: every draft accepted, then the token it expects and the drafts after it) for each row
  whose prediction held, and the prompt lookup (prompt_lookup_min / max) for the others, where the
  suffix tree's own answer would need the host. Only for steps of at most MAX_ROWS rows:
  on the H100 with SmolLM2 it beat the host's drafts after the commit at batch 1, 4 and 8 (1.50x
  against 1.38x, 1.33 / 1.30, 1.32 / 1.29) and, once the draft-length policy priced its steps at
  their cost, at batch 16 (1.34-1.38x against 1.22-1.36x in five paired rounds,
  results/spec_suffix_loop_b16_h100.json; before that repricing it lost there, 1.17x against 1.22x:
  more rows miss their prediction and the lookup finds fewer drafts than the suffix tree); larger
  steps keep verify ahead and the launch from committed tokens.
- a drafting layer (MTP, EAGLE-3: pyengine/spec_decode/layer_device_drafts.py): the kernel runs in
  two halves; between them the layer catches up on the step's tokens and chains its drafts from
  each row's accepted count, on the stream.
The lookup alone (ngram) is used up to MAX_ROWS rows as well: it beat the host's drafts at batch 16
(1.05-1.10x against 1.01x) and lost at batch 64 in 3 tasks of 4 (qa 0.89 / 0.93, math_reasoning
0.84 / 0.90, summarization 0.97 / 1.02; translation 0.98 / 0.95): a built step is padded to its
plan's longest row whether or not the lookup finds drafts, which a 64-row verify graph prices
(q = 5: 1.59 ms against 1.17 for q = 1). The host learns what was launched (accepted
counts, bonus tokens, drafts: one small copy, ordered before the replay) when it reads the step's
tokens, and hands the drafts to the scheduler as verify ahead does; the next step uses the launch
when the scheduler's batch is exactly it (PendingStep.matches), otherwise it is discarded.

The history (one int32 row per request slot, as long as a row's context may grow) is the host's
tokens: a row's tokens the device lacks (an admission, steps that did not pass through here) are
copied with the launch; the tokens a launch appends count once the host commits them (committed).

Losslessness is unchanged: a used step is the step the scheduler asks for, computed by the same
graph on the same inputs, and greedy verification commits the target's argmax continuation
whatever the drafts.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass

import numpy as np
import torch

from pyengine import _C
from pyengine.engine.host_arrays import draft_token_ids
from pyengine.engine.pending_step import PendingStep
from pyengine.ops import streams
from pyengine.ops.reference import next_verify_step as reference
from pyengine.ops.reference.next_verify_step import ACCEPT, LAYER_DRAFTS, PREDICTED, ROW_FIELDS, row_width
from pyengine.spec_decode.layer_device_drafts import LayerDeviceDrafts


@dataclass
class DeviceLaunch:
    """A step launched by DeviceVerifyLoop.launch, until the host reads what it holds (resolve)."""
    key: tuple[int, int]
    logits: torch.Tensor  # the graph's static logits, every token slot
    seq_ids: np.ndarray
    slots: np.ndarray  # request slots: the history rows
    first_positions: np.ndarray  # of each row's first token in the launching step
    tables: np.ndarray


class DeviceVerifyLoop:
    MAX_N = 64  # the longest n-gram the kernel looks up (next_verify_step.hip, kMaxN)
    MAX_ROWS = 16  # the most rows of a step built here, ngram's and suffix's (measured: module docstring)

    @classmethod
    def for_engine(cls, graph_runner, num_slots: int, spec, proposer) -> "DeviceVerifyLoop | None":
        """The loop of an engine with graph steps (graph_runner), speculative config `spec` and its
        proposer; None where it does not apply: another method, a longer n-gram than the kernel
        looks up, a drafting layer without graphs, or a CUDA device and an extension without the kernels."""
        if spec is None:
            return None
        layer = spec.method in ("mtp", "eagle3")
        if layer and getattr(proposer, "graphs", None) is None:
            return None
        if not layer and (spec.method not in ("ngram", "suffix") or spec.prompt_lookup_max > cls.MAX_N):
            return None
        if graph_runner.device.type == "cuda":
            try:
                importlib.import_module("pyengine.ops.cuda.next_verify_step")
            except ImportError:
                return None
        if layer:
            return cls(graph_runner, num_slots, 0, 0, drafter=proposer)
        return cls(graph_runner, num_slots, spec.lookup_min(graph_runner.device.type), spec.prompt_lookup_max,
                   predictor=proposer if spec.method == "suffix" else None)

    def __init__(self, graph_runner, num_slots: int, min_n: int, max_n: int, predictor=None, drafter=None) -> None:
        g = self.graphs = graph_runner
        self.min_n, self.max_n = min_n, max_n
        self.predictor = predictor  # a PredictingProposer whose predictions come first (suffix), or None
        self.max_rows = self.MAX_ROWS
        self.max_drafts = g.max_q - 1
        # a drafting layer's drafts between the kernel's halves (MtpProposer), or None
        self.layer = LayerDeviceDrafts(drafter) if drafter is not None else None
        self.max_context = g.width * g.block_size
        dev, pin = g.device, g.use_graphs
        self.history = torch.zeros(num_slots, self.max_context, dtype=torch.int32, device=dev)
        self.owner = np.full(num_slots, -1, dtype=np.int64)  # whose tokens a history row holds
        self.valid = np.zeros(num_slots, dtype=np.int64)  # ... and how many of them are the host's
        assert g.built_fields == row_width(self.max_drafts)
        self.rows_in = np.zeros((g.max_rows, g.built_fields), dtype=np.int64)  # staged by launch_built
        self.result = torch.zeros(g.max_rows, 3 + self.max_drafts, dtype=torch.int64, device=dev)
        self.host_result = torch.zeros(g.max_rows, 3 + self.max_drafts, dtype=torch.int64, pin_memory=pin)
        self.host_sync = torch.zeros(4096, dtype=torch.int32, pin_memory=pin)  # grows with the largest sync
        self.dev_sync = torch.zeros(4096, dtype=torch.int32, device=dev)
        self.staged = torch.cuda.Event() if pin else None  # the last launch's sync copy left host_sync
        self.ready = torch.cuda.Event() if pin else None  # the result reached the host
        # a drafting layer's launch: the result again once the layer's drafts are in it
        self.host_drafts = torch.zeros_like(self.host_result, pin_memory=pin)
        self.drafts_ready = torch.cuda.Event() if pin else None
        if dev.type == "cuda":
            from pyengine.ops.cuda.next_verify_step import next_verify_step
            self.kernel = next_verify_step
        else:
            self.kernel = reference.next_verify_step
        self._appended: tuple[np.ndarray, np.ndarray] | None = None  # (slots, first committed position)
        self._resolved: tuple | None = None  # the last resolved step's (seq ids, first positions, accepted)
        self.num_launched = self.num_used = 0

    def takes(self, batch) -> bool:
        """Should the step after `batch` be built here (else: the host's launch paths)?"""
        return batch.num_rows <= self.max_rows

    def launch(self, scheduler, batch, argmax: torch.Tensor, lengths: np.ndarray) -> DeviceLaunch | None:
        """Launch the step after `batch` (greedy decode / verify rows; argmax: its argmax on the
        device, one per token; lengths: the most drafts each row may get). None (nothing launched)
        where no row may draft, no captured graph holds the step, or a row's table lacks a block
        the longest outcome would need."""
        g, rows = self.graphs, batch.num_rows
        d = np.asarray(batch.num_draft_tokens[:rows], dtype=np.int64)
        if rows > g.max_rows or int(d.max(initial=0)) > self.max_drafts:
            return None
        left = np.asarray(batch.tokens_left[:rows], dtype=np.int64)
        cap = np.clip(np.minimum(np.minimum(lengths, self.max_drafts), left - 2), 0, None)
        if not cap.any():
            return None
        key = g._key(rows, np.array([1 + int(cap.max())]))
        if key is None or (g.use_graphs and key not in g.graphs):
            return None
        seq_ids = np.array(batch.seq_ids[:rows])
        tables = scheduler.block_tables(seq_ids)
        if tables.shape[1] > g.width:
            return None
        qsl = np.asarray(batch.query_start_loc[:rows + 1], dtype=np.int64)
        p0 = np.asarray(batch.positions, dtype=np.int64)[qsl[:-1]]
        # the longest outcome: every draft accepted, then cap drafts
        if _C.launch_rows(p0 + 1 + d, (1 + cap).astype(np.int32), tables, g.block_size, self.max_context) is None:
            return None
        if self.layer is not None and not self.layer.prepare(scheduler, seq_ids, p0, d, cap, tables):
            return None
        slots = np.asarray(batch.request_slots[:rows], dtype=np.int64)
        sync_from, sync_count, sync = self._sync(scheduler, seq_ids, slots, p0 + 1)
        info = self.rows_in[:rows]
        info[:, :PREDICTED] = np.stack([qsl[:-1], d, p0, cap, left, slots, sync_from, sync_count,
                                         np.cumsum(sync_count) - sync_count], axis=1)
        drafts = draft_token_ids(batch)
        info[:, ROW_FIELDS:ROW_FIELDS + self.max_drafts][np.arange(self.max_drafts)[None, :] < d[:, None]] = drafts
        info[:, PREDICTED] = 0
        if self.predictor is not None:
            pred, found = self.predictor.predict(scheduler, seq_ids, drafts.astype(np.int32), d.astype(np.int32),
                                                 cap.astype(np.int32))
            width = min(pred.shape[1], self.max_drafts + 1)
            info[:, PREDICTED] = np.minimum(found, width)
            info[:, ROW_FIELDS + self.max_drafts:ROW_FIELDS + self.max_drafts + width] = pred[:, :width]
        if len(sync):
            self._stage_sync(sync)
        b, q = key
        shape = dict(block_size=g.block_size, max_context=self.max_context, token_capacity=g.T, row_capacity=g.row_cap,
                     rows=rows, padded_rows=2 * b, q=q, token_slots=b * q, max_drafts=self.max_drafts,
                     min_n=self.min_n, max_n=self.max_n)

        def build() -> None:  # on the stream after the staging copy, before the replay
            if len(sync):
                streams.copy_async(self.dev_sync[:len(sync)], self.host_sync[:len(sync)], g.device, self.staged)
            args = (argmax, g.built_rows_device, self.dev_sync, self.history, g.dev32, g.dev64, self.result)
            if self.layer is None:
                self.kernel(*args, **shape)
            else:
                # the acceptance reaches the host before the layer's drafts (resolve waits for it
                # alone: the host commits while the GPU drafts; PendingStep.complete waits for the rest)
                self.kernel(*args, **shape, phase=ACCEPT)
                streams.copy_async(self.host_result[:rows], self.result[:rows], g.device, self.ready)
                drafts = self.layer.draft(argmax, self.result[:, 0], tables, p0, cap)
                self.kernel(*args, **shape, phase=LAYER_DRAFTS, layer_drafts=drafts)
                streams.copy_async(self.host_drafts[:rows], self.result[:rows], g.device, self.drafts_ready)
                return
            streams.copy_async(self.host_result[:rows], self.result[:rows], g.device, self.ready)

        logits = g.launch_built(key, tables, info, build)
        self.num_launched += 1
        return DeviceLaunch(key, logits, seq_ids, slots, p0, tables)

    def resolve(self, launched: DeviceLaunch, tokens: np.ndarray, counts: np.ndarray) -> PendingStep:
        """The launched step as the host sees it, once the launching step's tokens (tokens, counts
        per row: the greedy rule's, all finite) are known: its inputs, and the drafts the scheduler
        is to be given for it. The kernel's acceptance must be the host's."""
        if self.ready is not None:
            self.ready.synchronize()
        rows = len(launched.seq_ids)
        res = self.host_result.numpy()[:rows].copy()
        accepted, num_drafts, bonus = res[:, 0], res[:, 1], res[:, 2]
        assert np.array_equal(accepted + 1, counts) and np.array_equal(bonus, tokens[np.cumsum(counts) - 1]), \
            "the device's acceptance differs from the host's"
        g = self.graphs
        counts_next = (1 + num_drafts).astype(np.int32)
        built = _C.launch_rows(launched.first_positions + 1 + accepted, counts_next, launched.tables, g.block_size,
                               self.max_context)
        assert built is not None, "a launched row's positions lack blocks"
        qsl, pos, slot_mapping, ctx, num_blocks = built
        pending = PendingStep(launched.key, launched.logits[:int(qsl[-1])], launched.seq_ids, pos, slot_mapping, ctx,
                              launched.tables, num_blocks, qsl, from_device=True)
        if self.layer is None:
            self._take_drafts(pending, res)
        else:  # the layer's drafts arrive after the acceptance
            self._resolved = (launched.seq_ids, launched.first_positions, accepted)
            pending.fill = self._wait_for_drafts
        self._appended = (launched.slots, launched.first_positions + 1)
        return pending

    def _wait_for_drafts(self, pending: PendingStep) -> None:
        if self.drafts_ready is not None:
            self.drafts_ready.synchronize()
        self._take_drafts(pending, self.host_drafts.numpy()[:len(pending.seq_ids)].copy())

    def _take_drafts(self, pending: PendingStep, res: np.ndarray) -> None:
        """The launched step's input ids and the drafts the scheduler is to be given, from the
        result rows [accepted, drafts, bonus, drafts ...]."""
        num_drafts = res[:, 1]
        width = np.arange(1 + self.max_drafts)[None, :]
        pending.input_ids = res[:, 2:][width < 1 + num_drafts[:, None]]
        pending.drafts = (res[:, 3:][width[:, :-1] < num_drafts[:, None]].astype(np.int32), num_drafts.astype(np.int32))

    def adopted(self) -> None:
        """The last resolved step is the one the scheduler runs next (its drafts are taken): a
        drafting layer's state follows it (LayerDeviceDrafts.adopt)."""
        if self.layer is not None and self._resolved is not None:
            self.layer.adopt(*self._resolved)
        self._resolved = None

    def committed(self, num_committed: np.ndarray) -> None:
        """After the launching step's commit (scheduler.update): the tokens the kernel appended
        that the host committed are the host's (a row that stopped early keeps fewer)."""
        if self._appended is None:
            return
        slots, base = self._appended
        self._appended = None
        self.valid[slots] = base + np.asarray(num_committed[:len(slots)], dtype=np.int64)

    def _sync(self, scheduler, seq_ids: np.ndarray, slots: np.ndarray,
              need: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per row, the history positions the host must fill ([from, from + count)) for the row to
        hold its first `need` tokens, and those tokens (flat); the rows are the host's from then on."""
        have = np.minimum(np.where(self.owner[slots] == seq_ids, self.valid[slots], 0), need)
        count = need - have
        lack = count > 0
        if lack.any():
            flat, offsets = scheduler.token_ids_from(seq_ids[lack], have[lack])
            assert np.array_equal(np.diff(offsets), count[lack]), "the history would skip tokens"
        else:
            flat = np.zeros(0, dtype=np.int32)
        self.owner[slots], self.valid[slots] = seq_ids, need
        return have, count, flat

    def _stage_sync(self, tokens: np.ndarray) -> None:
        if self.staged is not None:
            self.staged.synchronize()  # the last sync's copy has left the host buffer
        n = len(tokens)
        if self.host_sync.shape[0] < n:
            size = max(n, 2 * self.host_sync.shape[0], 4096)
            self.host_sync = torch.zeros(size, dtype=torch.int32, pin_memory=self.graphs.use_graphs)
            self.dev_sync = torch.zeros(size, dtype=torch.int32, device=self.graphs.device)
        self.host_sync.numpy()[:n] = tokens
