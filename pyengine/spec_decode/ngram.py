"""The ngram (prompt-lookup) proposer: the lookup runs in C++ over the scheduler's own tokens."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from pyengine import _C
from pyengine.spec_decode.config import SpeculativeConfig


class NgramProposer:
    """Prompt lookup over prompt + generated tokens: one call into the scheduler for every row."""

    def __init__(self, cfg: SpeculativeConfig, device_type: str) -> None:
        self.min_n, self.max_n = cfg.lookup_min(device_type), cfg.prompt_lookup_max

    def propose(self, scheduler: _C.Scheduler, view: _C.DecodeView, max_drafts: np.ndarray) -> None:
        scheduler.propose_ngram(self.min_n, self.max_n, view.seq_ids, max_drafts)

    def predict(self, scheduler: _C.Scheduler, seq_ids: np.ndarray, drafts: np.ndarray, num_drafts: np.ndarray,
                lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Proposer.predict: the lookup over the tokens and the drafts in flight."""
        return scheduler.predict_ngram(self.min_n, self.max_n, seq_ids, drafts, num_drafts, lengths)

    def forget(self, seq_ids: Sequence[int], finished: bool) -> None:
        """Nothing to forget: the lookup keeps no state between steps."""
