"""Greedy steps without the general sampler: every row's token is an argmax.

Where every row of a step is greedy, the tokens the rejection sampler would give are a function of
the argmax of each logits row alone: a decode row takes its argmax; a verify row keeps its drafts
while each equals the argmax at its position, then takes the argmax after the last one kept. So a
step needs one argmax and one finite check where the logits are, one copy to pinned host memory and
one wait, and the acceptance bookkeeping in one C++ call on the host (csrc/core/greedy_accept.h;
the general sampler runs a dozen small torch ops per step there). The copies are asynchronous, so
the engine can launch the next step's forward between start() and the wait (async decode).
"""
from __future__ import annotations

import numpy as np
import torch

from pyengine import _C
from pyengine.engine.sampler import finite_rows
from pyengine.spec_decode.rejection_sampler import greedy_argmax

try:  # both reductions in one C++ call on CPU logits (the same values as the NumPy path below)
    from pyengine.ops.cpu.sampling import argmax_finite
except ImportError:  # no extension with the CPU ops
    argmax_finite = None


class GreedySampler:
    def __init__(self, min_rows: int) -> None:
        self.min_rows = min_rows  # buffers hold at least this many rows
        self._tok_dev = self._tok_host = self._fin_dev = self._fin_host = None
        self._ready: torch.cuda.Event | None = None

    def start(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.cuda.Event | None]:
        """Argmax and finite flag of each logits row: (device argmax, host argmax, host finite
        flags, the event to wait for before reading the host tensors; None on the CPU, where they
        are ready). The host tensors are reused by the next call."""
        n = logits.shape[0]
        if not logits.is_cuda:
            both = None if argmax_finite is None else argmax_finite(logits)
            if both is not None:
                return both[0], both[0], both[1], None
            tok = greedy_argmax(logits)
            return tok, tok, finite_rows(logits, tok), None
        if self._tok_dev is None or self._tok_dev.shape[0] < n:
            size = max(n, self.min_rows)
            self._tok_dev = torch.empty(size, dtype=torch.int64, device=logits.device)
            self._tok_host = torch.empty(size, dtype=torch.int64, pin_memory=True)
            self._fin_dev = torch.empty(size, dtype=torch.bool, device=logits.device)
            self._fin_host = torch.empty(size, dtype=torch.bool, pin_memory=True)
            self._ready = torch.cuda.Event()
        tok, host = self._tok_dev[:n], self._tok_host[:n]
        fin, fin_host = self._fin_dev[:n], self._fin_host[:n]
        torch.argmax(logits, dim=-1, out=tok)
        fin.copy_(finite_rows(logits, tok))  # before a launched step's replay overwrites the logits
        host.copy_(tok, non_blocking=True)
        fin_host.copy_(fin, non_blocking=True)
        self._ready.record()
        return tok, host, fin_host, self._ready

    def verify(self, batch, logits: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(tokens, counts per row, first_bad) of a step whose rows are all greedy, as
        LLMEngine._sample gives them: row r's num_logits[r] logits rows start its 1 + d_r target
        positions (d_r its drafts, none for prefill rows); first_bad None when every logits row
        that gave a token was finite, else per row the first of its tokens whose was not (-1: none)."""
        return self.accept(batch, *self.start(logits)[1:])

    def accept(self, batch, host: torch.Tensor, fin_host: torch.Tensor,
               ready: torch.cuda.Event | None) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """verify() after start(logits) (host, fin_host, ready: what start returned): the engine
        may launch the next step between the two."""
        if ready is not None:
            ready.synchronize()
        return _C.greedy_accept(host.numpy(), fin_host.numpy(), batch.num_logits, batch.num_draft_tokens,
                                batch.query_start_loc, batch.input_ids)
