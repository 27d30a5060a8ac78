"""GreedySampler.verify (all-greedy steps, NumPy bookkeeping) gives what the rejection sampler gives
greedy rows: accepted prefixes, correction / bonus tokens, per-row counts and the first emitted
token with non-finite logits - on random ragged steps with decode rows, verify rows and prefill rows
(one logits row or none)."""
from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from pyengine.engine.greedy_sampler import GreedySampler
from pyengine.sampling_params import SamplingParams
from pyengine.spec_decode.rejection_sampler import RejectionSampler

VOCAB = 11


def random_step(rng: np.random.Generator, nan: bool):
    rows = int(rng.integers(1, 7))
    num_decode = int(rng.integers(0, rows + 1))
    drafts = np.where(np.arange(rows) < num_decode, rng.integers(0, 4, rows), 0)
    # prefill rows: 1..5 tokens, the last chunk of a prompt wants one logits row, others none
    q_lens = np.where(np.arange(rows) < num_decode, 1 + drafts, rng.integers(1, 6, rows))
    num_logits = np.where(np.arange(rows) < num_decode, 1 + drafts, rng.integers(0, 2, rows))
    logits = torch.from_numpy(rng.normal(size=(int(num_logits.sum()), VOCAB)).astype(np.float32))
    argmax = logits.argmax(-1).numpy()
    qsl = np.concatenate(([0], np.cumsum(q_lens))).astype(np.int32)
    ids = rng.integers(0, VOCAB, int(qsl[-1])).astype(np.int32)
    starts = np.cumsum(num_logits) - num_logits
    for r in range(num_decode):  # drafts that agree with the argmax for a random prefix
        agree = int(rng.integers(0, drafts[r] + 1))
        for j in range(drafts[r]):
            t = argmax[starts[r] + j]
            ids[qsl[r] + 1 + j] = t if j < agree else (t + 1) % VOCAB
    if nan and len(logits):
        logits[int(rng.integers(0, len(logits))), int(rng.integers(0, VOCAB))] = float("nan")
    batch = types.SimpleNamespace(num_logits=num_logits.astype(np.int32), num_draft_tokens=drafts.astype(np.int32),
                                  query_start_loc=qsl, input_ids=ids, num_rows=rows)
    return batch, logits


def reference(batch, logits):
    """LLMEngine._sample's use of the rejection sampler, for greedy rows."""
    rows = np.nonzero(batch.num_logits)[0]
    counts = np.zeros(len(batch.num_logits), dtype=np.int32)
    if not len(rows):
        return np.zeros(0, np.int32), counts, None
    d = batch.num_draft_tokens[rows]
    starts = batch.query_start_loc[rows] + 1
    idx = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, d)] or [np.zeros(0, np.int64)]).astype(np.int64)
    out = RejectionSampler()(logits, torch.from_numpy(batch.input_ids[idx].astype(np.int64)),
                             torch.from_numpy(d.astype(np.int64)), None,
                             [SamplingParams(temperature=0)] * len(rows), [None] * len(rows))
    counts[rows] = out.num_tokens.numpy()
    bad = out.first_nonfinite.numpy()
    first_bad = None
    if (bad >= 0).any():
        first_bad = np.full(len(counts), -1, dtype=np.int64)
        first_bad[rows] = bad
    return out.flat_tokens.numpy().astype(np.int32), counts, first_bad


GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEVICES = ["cpu", pytest.param("cuda", marks=GPU), pytest.param("cuda-torch-ops", marks=GPU)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("nan", [False, True])
def test_verify_equals_the_rejection_sampler_on_greedy_rows(nan: bool, device: str, monkeypatch) -> None:
    """On CUDA the argmax and finite flags come from one kernel (hipkernels/sampling/greedy_rows.h),
    or from torch ops where the kernel does not run (cuda-torch-ops)."""
    if device == "cuda-torch-ops":
        monkeypatch.setattr("pyengine.engine.greedy_sampler.greedy_rows_into", None)
        device = "cuda"
    rng = np.random.default_rng(7 + nan)
    sampler = GreedySampler(4)
    saw_accept = saw_bad = 0
    for _ in range(300):
        batch, logits = random_step(rng, nan)
        want = reference(batch, logits)
        got = sampler.verify(batch, logits.to(device))
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
        assert (got[2] is None) == (want[2] is None)
        if want[2] is not None:
            assert np.array_equal(got[2], want[2])
            saw_bad += 1
        saw_accept += int((want[1] > 1).any())
    assert saw_accept > 50
    assert saw_bad > 20 if nan else saw_bad == 0
