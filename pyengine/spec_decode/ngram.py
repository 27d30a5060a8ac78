"""The ngram (prompt-lookup) proposer: its lookup runs in C++ (pyengine._C.propose_ngram)."""
from __future__ import annotations

import itertools
from typing import Mapping

import numpy as np

from pyengine import _C
from pyengine.spec_decode.config import SpeculativeConfig


class NgramProposer:
    """Prompt lookup over prompt + generated tokens, in C++ (pyengine/_C: propose_ngram)."""

    def __init__(self, cfg: SpeculativeConfig) -> None:
        self.min_n, self.max_n = cfg.prompt_lookup_min, cfg.prompt_lookup_max

    def propose(self, scheduler: _C.Scheduler, num_drafts: int, per_request: Mapping[int, int] | None = None) -> None:
        scheduler.propose_ngram(self.min_n, self.max_n, num_drafts)
        if not per_request or num_drafts <= 0:
            return
        # Shorter rows: the lookup with a smaller k returns a prefix of the same match, so
        # only rows that keep some drafts need their tokens (0-draft rows are just cleared).
        short = [(sid, n) for sid, n in per_request.items() if n < num_drafts]
        if not short:
            return
        drafts = [_C.propose_ngram(scheduler.token_ids(sid), self.min_n, self.max_n, n) if n > 0 else []
                  for sid, n in short]
        scheduler.set_draft_tokens_batch(np.fromiter((sid for sid, _ in short), np.int64, len(short)),
                                         np.fromiter(itertools.chain.from_iterable(drafts), np.int32),
                                         np.fromiter((len(d) for d in drafts), np.int32, len(short)))
