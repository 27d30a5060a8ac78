"""From a step's committed tokens to request outputs.

A streamed request (stream=True, or stop strings, which need the text) gets its tokens and text
every step, through its incremental detokenizer; a stop string in the text ends it. The others get
theirs once, when they finish, from the scheduler's finished outputs (one call per step for all of
them), so a step does no per-row Python work for them whatever the batch size.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pyengine import _C
from pyengine.sampling_params import SamplingParams
from pyengine.tokenizer import IncrementalDetokenizer


@dataclass
class Request:
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    # Streamed: output_token_ids and text grow every step; else they stay empty until it finishes.
    stream: bool = False
    output_token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None
    # EngineConfig.record_logits: the fp32 logits [vocab] that produced each output token
    logits: list = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class OutputProcessor:
    def __init__(self) -> None:
        self.streamed: set[int] = set()  # ids of the unfinished streamed requests

    def add(self, req: Request) -> None:
        if req.stream:
            self.streamed.add(req.request_id)

    def release(self, request_id: int) -> None:
        self.streamed.discard(request_id)

    def process(self, scheduler: _C.Scheduler, requests: dict[int, Request], batch, tokens: np.ndarray,
                counts: np.ndarray, num_committed: np.ndarray, reasons: np.ndarray) -> tuple[list[Request], int]:
        """Hand this step's tokens (scheduler.update's results for batch) to the requests that need
        them now: every row of a streamed request, and each request that finished. Returns them and
        the number of committed tokens dropped after a stop string."""
        touched: list[Request] = []
        num_dropped = 0
        if self.streamed:
            starts = np.cumsum(counts) - counts
            streamed = np.fromiter(self.streamed, np.int64, len(self.streamed))
            for r in np.nonzero(np.isin(batch.seq_ids, streamed) & (counts > 0))[0].tolist():
                req = requests[int(batch.seq_ids[r])]
                new = tokens[starts[r]:starts[r] + num_committed[r]].tolist()
                reason = _C.FINISH_REASONS[reasons[r]] if reasons[r] else None
                if req.params.stop:
                    num_dropped += self._add_until_stop(scheduler, req, new, reason)
                else:
                    req.output_token_ids.extend(new)
                    req.text += req.detokenizer.add(new)
                    if reason is not None:
                        req.finish_reason = reason
                        req.text += req.detokenizer.flush()
                touched.append(req)
        seq_ids, cu_num_tokens, output_ids = scheduler.finished_outputs()
        if len(seq_ids):
            rows = np.nonzero(reasons)[0]
            reason_of = dict(zip(batch.seq_ids[rows].tolist(), reasons[rows].tolist()))
        for i, sid in enumerate(seq_ids.tolist()):
            req = requests[sid]
            if not req.stream:
                req.output_token_ids = output_ids[cu_num_tokens[i]:cu_num_tokens[i + 1]].tolist()
                req.text = req.detokenizer.add(req.output_token_ids) + req.detokenizer.flush()
                req.finish_reason = _C.FINISH_REASONS[reason_of[sid]]
                touched.append(req)
        return touched, num_dropped

    @staticmethod
    def _add_until_stop(scheduler: _C.Scheduler, req: Request, new: list[int], reason: str | None) -> int:
        """Append `new` (the row's committed tokens; reason: how the scheduler finished it, if it
        did) one token at a time, as plain decoding would see them, until the text contains a stop
        string: the text ends before it, the tokens end with the one that completed it, and the
        tokens after it (accepted drafts) are dropped. Returns how many were dropped."""
        stops = req.params.stop or []
        for j, token in enumerate(new):
            last = j == len(new) - 1
            req.output_token_ids.append(token)
            before = len(req.text)
            req.text += req.detokenizer.add([token])
            if last and reason is not None:
                req.text += req.detokenizer.flush()
            found = [i for i in (req.text.find(stop, max(0, before - len(stop) + 1)) for stop in stops) if i >= 0]
            if found:
                req.text = req.text[:min(found)]
                # The scheduler's own stop (EOS, a stop id, a length limit) wins only when it came
                # with this very token; a request it still runs is aborted there.
                req.finish_reason = reason if last and reason is not None else "stop"
                if reason is None:
                    scheduler.abort_request(req.request_id)
                return len(new) - 1 - j
        if reason is not None:
            req.finish_reason = reason
        return 0
