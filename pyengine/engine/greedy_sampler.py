"""Greedy steps without the general sampler: every row's token is an argmax.

Where every row of a step is greedy, the tokens the rejection sampler would give are a function of
the argmax of each logits row alone: a decode row takes its argmax; a verify row keeps its drafts
while each equals the argmax at its position, then takes the argmax after the last one kept. So a
step needs one argmax and one finite check where the logits are (one kernel on CUDA), one copy to
pinned host memory and one wait, and the acceptance bookkeeping in one C++ call on the host
(csrc/core/greedy_accept.h; the general sampler runs a dozen small torch ops per step there). The
copy is asynchronous, so the engine can launch the next step's forward between start() and the
wait (async decode).
"""
from __future__ import annotations

import numpy as np
import torch

from pyengine import _C
from pyengine.engine.sampler import finite_rows
from pyengine.ops import streams
from pyengine.spec_decode.rejection_sampler import greedy_argmax

try:  # both reductions in one C++ call on CPU logits (the same values as the NumPy path below)
    from pyengine.ops.cpu.sampling import argmax_finite
except ImportError:  # no extension with the CPU ops
    argmax_finite = None

try:  # ... and in one kernel on CUDA logits
    from pyengine.ops.cuda.sampling import greedy_rows_into
except ImportError:  # no extension with the GPU kernels
    greedy_rows_into = None


class GreedySampler:
    def __init__(self, min_rows: int) -> None:
        self.min_rows = min_rows  # buffers hold at least this many rows
        # [argmax of N rows | their finite flags]: on the device, and its pinned host copy
        self._dev = self._host = None
        self._ready: torch.cuda.Event | None = None
        self._views: dict[int, tuple[torch.Tensor, ...]] = {}  # rows -> views of the two buffers

    def start(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.cuda.Event | None]:
        """Argmax and finite flag of each logits row: (device argmax, host argmax, host finite
        flags, the event to wait for before reading the host tensors; None on the CPU, where they
        are ready). The host tensors are reused by the next call. On CUDA one kernel computes both
        into one int64 buffer (hipkernels/sampling/greedy_rows.h; torch ops where it does not
        take the logits) and one copy brings them to the host; the flags are then int64 0 / 1."""
        n = logits.shape[0]
        if not logits.is_cuda:
            both = None if argmax_finite is None else argmax_finite(logits)
            if both is not None:
                return both[0], both[0], both[1], None
            tok = greedy_argmax(logits)
            return tok, tok, finite_rows(logits, tok), None
        if self._dev is None or self._dev.shape[0] < 2 * n:
            size = 2 * max(n, self.min_rows)
            self._dev = torch.empty(size, dtype=torch.int64, device=logits.device)
            self._host = torch.empty(size, dtype=torch.int64, pin_memory=True)
            self._ready = torch.cuda.Event()
            self._views = {}
        views = self._views.get(n)
        if views is None:  # slicing a tensor costs host time on every step: once per row count
            dev, host = self._dev[:2 * n], self._host[:2 * n]
            views = self._views[n] = (dev, host, dev[:n], host[:n], host[n:])
        dev, host, dev_tok, host_tok, host_fin = views
        if greedy_rows_into is None or not greedy_rows_into(logits, dev):
            torch.argmax(logits, dim=-1, out=dev_tok)
            dev[n:].copy_(finite_rows(logits, dev_tok))  # before a launched step's replay overwrites the logits
        streams.copy_async(host, dev, logits.device, self._ready)
        return dev_tok, host_tok, host_fin, self._ready

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
