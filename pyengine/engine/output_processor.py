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
    stopped_by_string: bool = False
    output_token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None

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
                counts: np.ndarray, num_committed: np.ndarray, reasons: np.ndarray) -> list[Request]:
        """Hand this step's tokens (scheduler.update's results for batch) to the requests that need
        them now: every row of a streamed request, and each request that finished. Returns them."""
        touched: list[Request] = []
        if self.streamed:
            starts = np.cumsum(counts) - counts
            streamed = np.fromiter(self.streamed, np.int64, len(self.streamed))
            for r in np.nonzero(np.isin(batch.seq_ids, streamed) & (counts > 0))[0].tolist():
                req = requests[int(batch.seq_ids[r])]
                new = tokens[starts[r]:starts[r] + num_committed[r]].tolist()
                req.output_token_ids.extend(new)
                if reasons[r]:
                    req.finish_reason = _C.FINISH_REASONS[reasons[r]]
                self._append_text(scheduler, req, req.detokenizer.add(new))
                if req.finished:
                    self._append_text(scheduler, req, req.detokenizer.flush())
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
        return touched

    @staticmethod
    def _append_text(scheduler: _C.Scheduler, req: Request, new_text: str) -> None:
        """Extend a streamed request's text; a stop string ends the request and is not part of
        the output text."""
        if req.stopped_by_string or not new_text:
            return
        before = len(req.text)
        req.text += new_text
        for stop in req.params.stop or []:
            idx = req.text.find(stop, max(0, before - len(stop) + 1))
            if idx >= 0:
                req.text = req.text[:idx]
                req.stopped_by_string = True
                if not req.finished:
                    req.finish_reason = "stop"
                    scheduler.abort_request(req.request_id)
                return
