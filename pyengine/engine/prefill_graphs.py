"""CUDA graphs for steps with prefill rows (CudaGraphRunner's part for them).

A step that mixes decode/verify rows with prefill rows runs as at most two replays: the decode
rows [0, num_decode_rows) on their decode/verify graph, the prefill rows after them on a prefill
graph. Rows never read each other's tokens or KV, so each row sees the same inputs as in one
eager forward. A prefill graph is keyed (b, -t): b rows (a bucket, at most PREFILL_GRAPH_ROWS) and
t token slots (16, 32, ... up to the runner's prefill_tokens), any row may hold all t; it computes
the logits of each row's last token only (a prefill row wants at most that one). Steps with more
prefill rows or tokens run eagerly: an eager step costs the Python of every layer (~10 ms for
SmolLM2), which a prefill that long amortises. Recurrent-state models keep prefill rows eager.
"""
from __future__ import annotations

import numpy as np
import torch

from pyengine.engine.step_parts import StepPart, rows_of

# prefill rows in one prefill graph: more (a first wave of admissions) run eagerly; the cap keeps the
# graphs (buckets x token capacities) few enough to capture at start-up (CudaGraphRunner.capture_all)
PREFILL_GRAPH_ROWS = 8
# Steps with prefill rows of up to this many tokens replay prefill graphs (the LLM's prefill_tokens):
# an eager step costs the Python of every layer, ~10 ms for SmolLM2; longer prefills amortise it
PREFILL_GRAPH_TOKENS = 2048


class PrefillGraphs:
    """Mixed into CudaGraphRunner: reads its buffers (_execute_part, graphs, buckets, ...)."""

    @property
    def prefill_rows(self) -> int:
        return min(PREFILL_GRAPH_ROWS, self.max_rows)

    def prefill_keys(self) -> list[tuple[int, int]]:
        """Every prefill graph key: row buckets up to prefill_rows, token capacities up to
        prefill_tokens, no more rows than tokens (none for recurrent-state models)."""
        if self.state_cache is not None:
            return []
        return [(b, -t) for b in self.buckets if b <= self.prefill_rows for t in self.prefill_buckets if b <= t]

    def prefill_key_for(self, part: StepPart) -> tuple[int, int] | None:
        """(bucket rows, -token capacity) when prefill rows can replay a prefill graph: at most
        prefill_rows rows and prefill_buckets[-1] tokens, each row wanting at most its last token's logits."""
        rows, n = part.num_rows, part.num_tokens
        if not self.prefill_buckets or rows == 0 or rows > self.prefill_rows or n > self.prefill_buckets[-1]:
            return None
        if self.state_cache is not None or part.num_decode_rows:  # recurrent state: prefill rows run eagerly
            return None
        nl = part.num_logits
        if int(nl.max()) > 1 or not np.array_equal(part.logits_indices, part.query_start_loc[1:][nl == 1] - 1):
            return None
        if part.block_tables.shape[1] > self.width or int(part.context_lens.max()) > self.width * self.block_size:
            return None
        b = next(x for x in self.buckets if x >= rows)
        return b, -next(t for t in self.prefill_buckets if t >= n)

    @torch.inference_mode()
    def execute_mixed(self, batch, keep_hidden: bool = False, aux: torch.Tensor | None = None,
                      token_patch: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor | None:
        """A step with prefill rows (and maybe decode/verify rows before them) as at most two replays:
        the decode rows on their decode/verify graph, the prefill rows on a prefill graph. Returns
        the step's logits in logits_indices order, or None when a part does not fit a graph (the
        caller runs the step eagerly). keep_hidden: last_hidden holds every token's hidden state
        (else None), or, given aux (the model's aux_out, which every replay rewrites from row 0:
        EAGLE-3), every token's aux states. token_patch: ModelRunner.execute's (its indices lie in
        the decode rows, which come first: the decode part's token indices are the batch's)."""
        d, rows = int(batch.num_decode_rows), len(batch.context_lens)
        if not self.prefill_buckets or d == rows:
            return None
        prefill = rows_of(batch, d, rows)
        pkey = self.prefill_key_for(prefill)
        decode = rows_of(batch, 0, d) if d else None
        dkey = self.bucket_for(decode) if decode is not None else None
        if pkey is None or (decode is not None and dkey is None):
            return None
        logits, hidden = [], []
        if decode is not None:
            # copies, taken before the prefill graph replays: the graphs share one memory pool, and
            # a graph captured later may hold its static outputs where the other's temporaries go
            logits.append(self._execute_part(decode, dkey, token_patch)[:decode.num_tokens].clone())
            if keep_hidden:
                hidden.append((self.last_hidden if aux is None else aux[:decode.num_tokens]).clone())
        out = self._execute_part(prefill, pkey)
        hidden.append(self.last_hidden if aux is None else aux[:prefill.num_tokens])
        want = np.nonzero(prefill.num_logits)[0]
        if not len(want) or want[-1] == len(want) - 1:  # rows 0..m-1 want logits: a view
            logits.append(out[:len(want)])
        else:
            logits.append(out.index_select(0, torch.from_numpy(want).to(out.device)))
        self.last_hidden = None if not keep_hidden else hidden[0] if len(hidden) == 1 else torch.cat(hidden)
        self.num_mixed += 1
        return logits[0] if len(logits) == 1 else torch.cat(logits)
