"""What a step leaves on its requests besides tokens: each committed token's logits (the
losslessness checker, EngineConfig.record_logits) and its logprobs (SamplingParams.logprobs).
A row's logits are its num_logits consecutive rows of the step's logits; the first num_committed
of them gave committed tokens."""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from pyengine.engine.sampler import token_logprobs
from pyengine.outputs import Logprob


class TokenTexts:
    """Token id -> its text (Logprob.decoded_token), decoded once."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer, self.texts = tokenizer, {}

    def __call__(self, token_id: int) -> str:
        text = self.texts.get(token_id)
        if text is None:
            text = self.texts[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text


def record_logits(requests: dict, batch, logits: torch.Tensor, num_committed: np.ndarray) -> None:
    """Each committed token's logits (fp32, CPU) onto its request."""
    starts = np.cumsum(batch.num_logits) - batch.num_logits
    host = logits.float().cpu()
    for r in np.nonzero(num_committed)[0].tolist():
        req = requests[int(batch.seq_ids[r])]
        req.logits.extend(host[starts[r]:starts[r] + num_committed[r]].unbind(0))


def record_logprobs(requests: dict, batch, logits: torch.Tensor, tokens: np.ndarray, counts: np.ndarray,
                    num_committed: np.ndarray, text_of: TokenTexts) -> None:
    """Each committed token's Logprob entries onto the requests that asked for them, computed from
    the same logits rows as record_logits, in one call for the step."""
    starts = np.cumsum(batch.num_logits) - batch.num_logits
    token_starts = np.cumsum(counts) - counts
    rows, rows_idx, tok_idx = [], [], []
    for r in np.nonzero(num_committed)[0].tolist():
        req = requests[int(batch.seq_ids[r])]
        if req.logprobs is not None:
            n = int(num_committed[r])
            rows.append((req, n))
            rows_idx.extend(range(starts[r], starts[r] + n))
            tok_idx.extend(range(token_starts[r], token_starts[r] + n))
    if not rows:
        return
    chosen = torch.from_numpy(tokens[tok_idx].astype(np.int64)).to(logits.device)
    num_top = max(req.params.logprobs for req, _ in rows)
    lp, rank, top_ids, top_lp = (t.cpu().tolist() for t in token_logprobs(
        logits[torch.tensor(rows_idx, device=logits.device)], chosen, num_top))
    chosen_ids = chosen.tolist()
    i = 0
    for req, n in rows:
        k = req.params.logprobs
        for j in range(i, i + n):
            entry = {chosen_ids[j]: Logprob(lp[j], rank[j], text_of(chosen_ids[j]))}
            for t, v, pos in zip(top_ids[j][:k], top_lp[j][:k], range(1, k + 1)):
                entry.setdefault(t, Logprob(v, pos, text_of(t)))
            req.logprobs.append(entry)
        i += n
