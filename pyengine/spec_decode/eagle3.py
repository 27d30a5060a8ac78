"""EAGLE-3 speculation (`speculative_config={"method": "eagle3", "model": DIR, "num_speculative_tokens": k}`):
a one-layer draft head (pyengine/models/eagle3.py) proposes k chained drafts per running decode
request from three of the target's intermediate hidden states.

It drafts exactly as the MTP proposer does (pyengine/spec_decode/mtp.py: a catch-up over the
positions the target's previous step computed, then k - 1 chained steps on the head's own output,
its KV cache in the target's block tables, SchedulerConfig.drafter_lookahead = k). What differs:
the target keeps the residual stream at the input of the head's aux layers instead of its final
hidden state (ModelRunner.keep_aux_hidden: no extra pass, and on CUDA the graphs write them too),
the catch-up feeds fc(those states), and the head's draft vocabulary maps to target ids through d2t,
so its logits (and q for the rejection sampler) are over the target's vocabulary.
On CUDA the head's decode catch-ups and chained drafts replay CUDA graphs (MtpProposer.graphs,
pyengine/spec_decode/head_graphs.py); prefill catch-ups run eagerly.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from pyengine.engine.model_runner import ModelRunner
from pyengine.models.eagle3 import Eagle3Head
from pyengine.spec_decode.config import SpeculativeConfig
from pyengine.spec_decode.mtp import MtpProposer


class Eagle3Proposer(MtpProposer):
    def __init__(self, cfg: SpeculativeConfig, runner: ModelRunner, get_request: Callable[[int], Any], seed: int,
                 max_model_len: int, head: Eagle3Head) -> None:
        runner.keep_aux_hidden(head.aux_layers)
        super().__init__(cfg, runner, get_request, seed, max_model_len, layer=head)
        self.head = head

    def target_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head.combine(hidden)
