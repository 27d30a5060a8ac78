"""A test-only proposer: drafts whatever a script returns, so tests can force any acceptance
pattern. Installed on an ngram engine in place of its proposer; pyengine knows nothing of it.

    llm = make_llm(path, {"method": "scripted", "num_speculative_tokens": k, "script": fn}, ...)
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from pyengine import LLM

# script(request_id, committed_token_ids) -> drafts
DraftScript = Callable[[int, list[int]], list[int]]


class ScriptedProposer:
    """Proposes the script's drafts, truncated to each row's length."""

    def __init__(self, script: DraftScript) -> None:
        self.script = script

    def propose(self, scheduler: Any, view: Any, max_drafts: np.ndarray) -> None:
        for seq_id, n in zip(view.seq_ids.tolist(), max_drafts.tolist()):
            drafts = list(self.script(seq_id, scheduler.token_ids(seq_id)))[:n]
            scheduler.set_draft_tokens(seq_id, drafts)

    def predict(self, scheduler: Any, seq_ids: np.ndarray, drafts: np.ndarray, num_drafts: np.ndarray,
                lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """PredictingProposer.predict: the script's drafts after the tokens and the drafts in flight."""
        out = np.zeros((len(seq_ids), 1 + int(lengths.max(initial=0))), dtype=np.int32)
        counts = np.zeros(len(seq_ids), dtype=np.int32)
        starts = np.cumsum(num_drafts) - num_drafts
        for i, (seq_id, s, d, n) in enumerate(zip(seq_ids.tolist(), starts.tolist(), num_drafts.tolist(),
                                                  lengths.tolist())):
            tokens = list(scheduler.token_ids(seq_id)) + drafts[s:s + d].tolist()
            got = list(self.script(seq_id, tokens))[:1 + n]
            out[i, :len(got)] = got
            counts[i] = len(got)
        return out, counts

    def forget(self, seq_ids: Sequence[int], finished: bool) -> None:
        pass


def make_llm(model: str | None, spec: dict[str, Any] | None = None, **llm_kw: Any) -> LLM:
    """LLM(model, speculative_config=spec, **llm_kw); a spec of method "scripted" gives an ngram
    engine (every row asks for k drafts: scripted drafts are exact, never shortened) whose
    proposer is the script's."""
    if spec is None or spec.get("method") != "scripted":
        return LLM(model=model, speculative_config=spec, **llm_kw)
    ngram = {"method": "ngram", "num_speculative_tokens": spec["num_speculative_tokens"],
             "adaptive_draft_length": False}
    llm = LLM(model=model, speculative_config=ngram, **llm_kw)
    llm.engine.proposer = ScriptedProposer(spec["script"])
    return llm
