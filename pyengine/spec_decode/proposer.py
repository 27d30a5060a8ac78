"""The proposer interface and the factory that builds one from a SpeculativeConfig.

A proposer runs before schedule() and gives each running decode request 0..k draft tokens through
the scheduler; verification (pyengine.spec_decode.rejection_sampler) decides what is kept.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Protocol

from pyengine import _C
from pyengine.spec_decode.config import SpeculativeConfig


class Proposer(Protocol):
    def propose(self, scheduler: _C.Scheduler, num_drafts: int, per_request: Mapping[int, int] | None = None) -> None:
        """Give each running decode request up to num_drafts drafts; per_request (seq id -> length,
        each <= num_drafts) lowers that for the requests it names."""
        ...


class ScriptedProposer:
    """Proposes whatever the script returns (truncated to num_drafts): tests force acceptance patterns."""

    def __init__(self, cfg: SpeculativeConfig) -> None:
        assert cfg.script is not None
        self.script = cfg.script

    def propose(self, scheduler: _C.Scheduler, num_drafts: int, per_request: Mapping[int, int] | None = None) -> None:
        for seq_id in scheduler.running_ids():
            tokens = scheduler.token_ids(seq_id)
            if scheduler.num_computed(seq_id) != len(tokens) - 1:
                continue  # still prefilling: no drafts
            n = num_drafts if per_request is None else min(num_drafts, per_request.get(seq_id, num_drafts))
            drafts = list(self.script(seq_id, tokens))[:n]
            scheduler.set_draft_tokens(seq_id, drafts)


def build_proposer(spec: SpeculativeConfig, runner: Any, get_request: Callable[[int], Any], seed: int,
                   max_model_len: int, draft: tuple | None = None) -> Proposer:
    """The proposer for spec.method. runner: the target's ModelRunner (a draft model shares its
    block geometry); get_request: seq id -> the engine's Request; draft: (model, ModelConfig) when
    LLM preloaded the draft model, else it is loaded from spec.model."""
    if spec.method == "ngram":
        from pyengine.spec_decode.ngram import NgramProposer

        return NgramProposer(spec)
    if spec.method == "scripted":
        return ScriptedProposer(spec)
    from pyengine.spec_decode.draft_model import DraftModelProposer

    return DraftModelProposer(spec, runner, get_request, seed, max_model_len, draft=draft)
