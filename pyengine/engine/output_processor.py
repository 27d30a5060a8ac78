"""From a step's committed tokens to request outputs.

A streamed request (stream=True, or stop strings, which need the text) gets its tokens and text
every step, through its incremental detokenizer; a stop string in the text ends it. The others get
theirs once, when they finish, from the scheduler's finished outputs (one call per step for all of
them), so a step does no per-row Python work for them whatever the batch size.

A request whose logits had a NaN or an inf where one of its tokens would come from ends with
finish_reason "error" and error "request <id>: non-finite logits at output position N" (N: the
index in its output of the token those logits would have given); it keeps the tokens before N.
The step's sampler reports such rows; hold_back_nonfinite cuts their tokens before the
scheduler's update and process() ends them.
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
    # SamplingParams.logprobs set: per output token, {token id: Logprob} (sampled token + top n)
    logprobs: list | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class OutputProcessor:
    def __init__(self) -> None:
        self.streamed: set[int] = set()  # ids of the unfinished streamed requests
        # hold_back_nonfinite -> the next process(): seq id -> (row, tokens kept), rows that end with an error
        self._errors: dict[int, tuple[int, int]] = {}

    def add(self, req: Request) -> None:
        if req.stream:
            self.streamed.add(req.request_id)

    def release(self, request_id: int) -> None:
        self.streamed.discard(request_id)

    def abort(self, req: Request) -> None:
        """req was aborted between steps (LLMEngine.abort_request): it keeps the output it has (a
        streamed request: its tokens and text so far, the detokenizer flushed) and ends with
        finish_reason "abort"; nothing of it is kept here."""
        self.release(req.request_id)
        self._errors.pop(req.request_id, None)
        if req.stream:
            req.text += req.detokenizer.flush()
        req.finish_reason = "abort"

    def hold_back_nonfinite(self, batch, tokens: np.ndarray, counts: np.ndarray,
                            first_bad: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Before scheduler.update: rows whose logits were non-finite (first_bad[r] >= 0: the first
        of the row's tokens that came from such logits) keep only the tokens before that one. The
        scheduler commits at least one token per row with logits, so a row left with none commits
        a filler token (the first of its tokens), which is not output: the caller zeroes its
        num_committed. Returns (tokens, counts, the filler rows); the next process() ends these
        requests with an error (or normally, when a kept token already finished them)."""
        rows = np.nonzero(first_bad >= 0)[0]
        starts = np.cumsum(counts) - counts
        kept = first_bad[rows].astype(np.int32)
        new_counts = counts.copy()
        new_counts[rows] = np.maximum(kept, 1)
        keep = np.ones(len(tokens), dtype=bool)
        for r, c in zip(rows.tolist(), new_counts[rows].tolist()):
            keep[starts[r] + c:starts[r] + counts[r]] = False
        self._errors = {int(batch.seq_ids[r]): (r, k) for r, k in zip(rows.tolist(), kept.tolist())}
        return tokens[keep], new_counts, rows[kept == 0]

    def process(self, scheduler: _C.Scheduler, requests: dict[int, Request], batch, tokens: np.ndarray,
                counts: np.ndarray, num_committed: np.ndarray, reasons: np.ndarray) -> tuple[list[Request], int]:
        """Hand this step's tokens (scheduler.update's results for batch) to the requests that need
        them now: every row of a streamed request, and each request that finished (or ended with an
        error: hold_back_nonfinite). Returns them and the number of committed tokens dropped after
        a stop string."""
        touched: list[Request] = []
        num_dropped = 0
        errors, self._errors = self._errors, {}
        for sid, (r, kept) in list(errors.items()):
            if kept and reasons[r]:  # a kept token finished it (EOS, a stop id, its length): no error
                del errors[sid]
        if self.streamed:
            starts = np.cumsum(counts) - counts
            streamed = np.fromiter(self.streamed, np.int64, len(self.streamed))
            for r in np.nonzero(np.isin(batch.seq_ids, streamed) & (counts > 0))[0].tolist():
                sid = int(batch.seq_ids[r])
                req = requests[sid]
                new = tokens[starts[r]:starts[r] + num_committed[r]].tolist()
                # an error row's reason, if any, is its filler token's
                reason = _C.FINISH_REASONS[reasons[r]] if reasons[r] and sid not in errors else None
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
                out = output_ids[cu_num_tokens[i]:cu_num_tokens[i + 1]].tolist()
                if sid in errors:  # its filler token finished it: not output
                    self._end_with_error(req, out[:-1])
                    del errors[sid]
                else:
                    req.output_token_ids = out
                    req.text = req.detokenizer.add(req.output_token_ids) + req.detokenizer.flush()
                    req.finish_reason = _C.FINISH_REASONS[reason_of[sid]]
                touched.append(req)
        for sid, (r, kept) in errors.items():
            req = requests[sid]
            if req.finished:  # a stop string among its kept tokens ended it (and aborted it)
                continue
            out = None
            if not reasons[r]:  # still in the scheduler
                if not req.stream:  # its tokens, less a filler
                    out = scheduler.token_ids(sid)[len(req.prompt_token_ids):]
                    out = out[:len(out) - (kept == 0)]
                scheduler.abort_request(sid)
            self._end_with_error(req, out)
            if not req.stream:
                touched.append(req)
        return touched, num_dropped

    @staticmethod
    def _end_with_error(req: Request, output_token_ids: list[int] | None) -> None:
        """End req at non-finite logits, after its output so far (output_token_ids: a request that
        is not streamed gets them here; a streamed one has them)."""
        if output_token_ids is None:
            req.text += req.detokenizer.flush()
        else:
            req.output_token_ids = output_token_ids
            req.text = req.detokenizer.add(output_token_ids) + req.detokenizer.flush()
        req.finish_reason = "error"
        req.error = f"request {req.request_id}: non-finite logits at output position {len(req.output_token_ids)}"

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
