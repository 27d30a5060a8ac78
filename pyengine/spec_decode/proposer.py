"""The proposer interface and the factory that builds one from a SpeculativeConfig.

A proposer runs before schedule() and gives each running decode request 0..k draft tokens through
the scheduler; verification (pyengine.spec_decode.rejection_sampler) decides what is kept.
"""
from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence

import numpy as np

from pyengine import _C
from pyengine.spec_decode.config import SpeculativeConfig


class Proposer(Protocol):
    def propose(self, scheduler: _C.Scheduler, view: _C.DecodeView, max_drafts: np.ndarray) -> None:
        """Give row i of the scheduler's decode view up to max_drafts[i] drafts (int32, 0..k)."""
        ...

    def forget(self, seq_ids: Sequence[int], finished: bool) -> None:
        """These requests left the running set: preempted (finished False, they come back and
        re-prefill) or finished. Per-request state the proposer keeps goes."""
        ...


class PredictingProposer(Proposer, Protocol):
    """A proposer on the host (ngram, suffix) that can also draft for the step after the one in
    flight, as if every row accepts all its drafts (pyengine/engine/verify_ahead.py)."""

    def predict(self, scheduler: _C.Scheduler, seq_ids: np.ndarray, drafts: np.ndarray, num_drafts: np.ndarray,
                lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Rows seq_ids carry num_drafts[i] drafts in flight (the next ones of drafts, int32). Per
        row up to 1 + lengths[i] tokens that would follow them: the token the target is expected to
        add after them, then drafts. Returns (tokens [rows, 1 + k] int32, counts [rows])."""
        ...


def build_proposer(spec: SpeculativeConfig, runner: Any, get_request: Callable[[int], Any], seed: int,
                   max_model_len: int, draft: tuple | None = None) -> Proposer:
    """The proposer for spec.method. runner: the target's ModelRunner (a draft model shares its
    block geometry); get_request: seq id -> the engine's Request (running requests only); draft:
    (model, ModelConfig) when LLM preloaded the draft model (else it is loaded from spec.model), or
    the EAGLE-3 head and its config (method "eagle3": always preloaded)."""
    if spec.method == "ngram":
        from pyengine.spec_decode.ngram import NgramProposer

        return NgramProposer(spec, runner.device.type)
    if spec.method == "suffix":
        from pyengine.spec_decode.suffix import SuffixProposer

        return SuffixProposer(spec)
    if spec.method == "mtp":
        from pyengine.spec_decode.mtp import MtpProposer

        return MtpProposer(spec, runner, get_request, seed, max_model_len)
    if spec.method == "eagle3":
        from pyengine.spec_decode.eagle3 import Eagle3Proposer

        if draft is None:
            raise ValueError("speculative method 'eagle3': LLM loads the head (pyengine.models.eagle3.load_eagle3) "
                             "and passes it as draft")
        return Eagle3Proposer(spec, runner, get_request, seed, max_model_len, head=draft[0])
    from pyengine.spec_decode.draft_model import DraftModelProposer

    return DraftModelProposer(spec, runner, get_request, seed, max_model_len, draft=draft)
