"""Suffix decoding (method "suffix"): drafts from the continuations of the longest recurring suffix
of a request's tokens, in its own prompt and output and in a cache of recently finished requests
(csrc/core/suffix_proposer.h; the idea of Arctic Inference's suffix decoding). The indexes live in
C++ and grow with each request's committed tokens; one call per step drafts every row."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from pyengine import _C
from pyengine.spec_decode.config import SpeculativeConfig


class SuffixProposer:
    def __init__(self, cfg: SpeculativeConfig) -> None:
        self.impl = _C.SuffixProposer(cfg.suffix_max_depth, cfg.suffix_max_spec_factor, cfg.suffix_min_token_prob,
                                      cfg.suffix_max_cached_tokens)

    def propose(self, scheduler: _C.Scheduler, view: _C.DecodeView, max_drafts: np.ndarray) -> None:
        scheduler.propose_suffix(self.impl, view.seq_ids, max_drafts)

    def predict(self, scheduler: _C.Scheduler, seq_ids: np.ndarray, drafts: np.ndarray, num_drafts: np.ndarray,
                lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Proposer.predict: the chain after the drafts in flight."""
        return scheduler.predict_suffix(self.impl, seq_ids, drafts, num_drafts, lengths)

    def forget(self, seq_ids: Sequence[int], finished: bool) -> None:
        """A finished request's tokens join the shared cache; a preempted one keeps its index."""
        for seq_id in seq_ids:
            self.impl.forget(int(seq_id), finished)
