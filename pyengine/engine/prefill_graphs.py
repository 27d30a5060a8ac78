"""CUDA graphs for steps with prefill rows (CudaGraphRunner's part for them).

A step with prefill rows, decode/verify rows beside them or not, replays one prefill graph. A
prefill graph is keyed (b, -t): b rows (a bucket, at most PREFILL_GRAPH_ROWS) and t token slots
(16, 32, ... up to the runner's prefill_tokens), any row holding any number of them; it computes
the logits of the tokens a staged index list names (the step's logits_indices: every token of a
decode/verify row, the last token of a prefill row that ends its prompt), min(t, b * max_q) of
them at most. The kernels read each row's tokens through query_start_loc, so a row's arithmetic is
what an eager step gives it (the batch-invariant rule), and the attention kernels number only the
query tiles the rows hold (PagedAttentionParams.max_num_tokens), so a graph of many rows costs
little more than one of a single prompt. Steps with more rows or tokens run eagerly: an eager step
costs the Python of every layer (~10 ms for SmolLM2), which a prefill that long amortises.
Recurrent-state models keep prefill rows eager.

Why one replay: a step that admits a request beside running rows (under speculation rows finish
at different steps, so most admissions are such steps) ran as two replays, the decode rows' graph
then the prompt's, each paying the launch-bound floor of a step (~1 ms for SmolLM2 on an H100).
"""
from __future__ import annotations

import numpy as np

# rows in one prefill graph: steps with more (a first wave of admissions at a large batch) run
# eagerly; graphs are captured on first use, and each holds logits for up to min(t, b * max_q) tokens
PREFILL_GRAPH_ROWS = 64
# Steps with prefill rows of up to this many tokens replay prefill graphs (the LLM's prefill_tokens):
# an eager step costs the Python of every layer, ~10 ms for SmolLM2; longer prefills amortise it
PREFILL_GRAPH_TOKENS = 2048


class PrefillGraphs:
    """Mixed into CudaGraphRunner: reads its buffers (np64, buckets, max_q, ...); ModelRunner replays a
    prefill key through CudaGraphRunner.execute."""

    @property
    def prefill_rows(self) -> int:
        return min(PREFILL_GRAPH_ROWS, self.max_rows)

    def prefill_keys(self) -> list[tuple[int, int]]:
        """Every prefill graph key: row buckets up to prefill_rows, token capacities up to
        prefill_tokens, no more rows than tokens (none for recurrent-state models)."""
        if self.state_cache is not None:
            return []
        return [(b, -t) for b in self.buckets if b <= self.prefill_rows for t in self.prefill_buckets if b <= t]

    def logits_slots(self, key: tuple[int, int]) -> int:
        """Tokens whose logits a prefill graph computes: min(t, b * max_q) (each row wants at most
        max_q: a verify row's tokens, or a prefill row's last)."""
        b, t = key[0], -key[1]
        return min(t, b * self.max_q)

    def prefill_key_for(self, batch) -> tuple[int, int] | None:
        """(bucket rows, -token capacity) when a step with prefill rows can replay a prefill graph:
        at most prefill_rows rows and prefill_buckets[-1] tokens, no row wanting more than max_q
        logits, and block tables within the graphs' width."""
        rows = len(batch.context_lens)
        n = int(batch.query_start_loc[rows])
        if not self.prefill_buckets or rows == 0 or rows > self.prefill_rows or n > self.prefill_buckets[-1]:
            return None
        if self.state_cache is not None:  # recurrent state: prefill rows run eagerly
            return None
        if int(np.max(batch.num_logits)) > self.max_q:
            return None
        if not self._tables_fit(batch):
            return None
        b = next(x for x in self.buckets if x >= rows)
        t = next((t for t in self.prefill_buckets if t >= max(n, b)), None)
        return None if t is None else (b, -t)

    def _stage_logits(self, key: tuple[int, int], logits_indices) -> None:
        """The tokens whose logits a prefill graph computes, staged after the step's inputs (the
        slots after them repeat token 0: their logits are dropped)."""
        li = self.np64[self.logits_at:self.logits_at + self.logits_slots(key)]
        m = len(logits_indices)
        li[:m] = logits_indices
        li[m:] = 0
