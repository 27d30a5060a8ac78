"""Speculative verification: greedy exactness, edge cases, and distribution preservation.

The distribution tests use a tiny fixed "model" over V = 8 tokens: the target (and draft)
distribution of the next token depends on the previous token through a fixed random logits
table. 20k independent rows, each with its own generator, run one verify step from the same
context; the emitted tokens must follow the processed target distribution p.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import pytest
import torch
from scipy import stats

from pyengine.spec_decode.rejection_sampler import RejectionOutput, RejectionSampler
from pyengine.engine.sampler import RequestGenerators, draw_uniforms, probs_from_params, sample_from_probs
from pyengine.sampling_params import SamplingParams
from tests.test_sampling import sample


def token_rows(out: RejectionOutput) -> list[list[int]]:
    """Each row's tokens: accepted drafts, then the correction or bonus token."""
    return [t.tolist() for t in torch.split(out.flat_tokens, out.num_tokens.tolist())]

GREEDY = SamplingParams(temperature=0)
V = 8
N_TRIALS = 20000
CONTEXT = 3
TABLE_GEN = torch.Generator().manual_seed(1234)
TARGET_TABLE = torch.randn(V, V, generator=TABLE_GEN)  # logits of p(next | previous)
DRAFT_TABLE = torch.randn(V, V, generator=TABLE_GEN) * 1.5  # a substantially different q


# ---------------------------------------------------------------- greedy


def greedy_reference(logits: torch.Tensor, drafts: list[int]) -> list[int]:
    """Sequential greedy decoding: what the target alone would have produced."""
    out = []
    for j, x in enumerate(drafts):
        out.append(int(logits[j].argmax()))
        if out[-1] != x:
            return out
    return out + [int(logits[len(drafts)].argmax())]


def verify(logits, drafts_per_row: list[list[int]], params, gens, draft_probs=None):
    flat = torch.tensor([t for row in drafts_per_row for t in row], dtype=torch.long)
    counts = [len(row) for row in drafts_per_row]
    return RejectionSampler()(logits, flat, counts, draft_probs, params, gens)


@pytest.mark.parametrize("accepted", range(5))
def test_greedy_every_acceptance_count(accepted: int) -> None:
    k = 4
    logits = torch.randn(k + 1, 20, generator=torch.Generator().manual_seed(accepted))
    argmaxes = logits.argmax(-1).tolist()
    drafts = argmaxes[:accepted] + [(t + 1) % 20 for t in argmaxes[accepted:k]]
    out = verify(logits, [drafts], [GREEDY], [None])
    expected = argmaxes[: accepted + 1]  # accepted drafts, then correction or bonus
    assert token_rows(out) == [expected] and out.num_accepted.tolist() == [accepted]
    assert out.num_tokens.tolist() == [accepted + 1] and out.flat_tokens.tolist() == expected


def test_greedy_ragged_batch_matches_sequential_reference() -> None:
    gen = torch.Generator().manual_seed(7)
    vocab, rows = 5, 300
    counts = torch.randint(0, 5, (rows,), generator=gen).tolist()
    counts[:3] = [0, 4, 0]
    logits = torch.randn(sum(counts) + rows, vocab, generator=gen)
    drafts, start = [], 0
    for d in counts:
        argmaxes = logits[start:start + d].argmax(-1)
        noise = torch.randint(0, vocab, (d,), generator=gen)
        keep = torch.rand(d, generator=gen) < 0.8  # mostly right, so long accepted runs occur
        drafts.append(torch.where(keep, argmaxes, noise).tolist())
        start += d + 1
    out = verify(logits, drafts, [GREEDY] * rows, [None] * rows)
    start, seen = 0, set()
    for r, d in enumerate(counts):
        assert token_rows(out)[r] == greedy_reference(logits[start:start + d + 1], drafts[r])
        seen.add((d, int(out.num_accepted[r])))
        start += d + 1
    assert out.flat_tokens.tolist() == [t for row in token_rows(out) for t in row]
    assert {(4, a) for a in range(5)} <= seen  # every outcome was exercised


def test_mixed_greedy_and_random_rows() -> None:
    gen = torch.Generator().manual_seed(3)
    counts = [3, 0, 2, 3]
    logits = torch.randn(sum(counts) + 4, 10, generator=gen)
    drafts = [[1, 2, 3], [], [4, 5], [6, 7, 8]]
    params = [GREEDY, SamplingParams(seed=1), GREEDY, SamplingParams(seed=2, top_k=3)]
    pool = RequestGenerators()
    out = verify(logits, drafts, params, [None, pool.get(1, 1), None, pool.get(3, 2)])
    assert token_rows(out)[0] == greedy_reference(logits[0:4], drafts[0])
    assert token_rows(out)[2] == greedy_reference(logits[5:8], drafts[2])
    assert len(token_rows(out)[1]) == 1 and 1 <= len(token_rows(out)[3]) <= 4


def test_zero_draft_rows_match_plain_sampler() -> None:
    logits = torch.randn(6, 30, generator=torch.Generator().manual_seed(4))
    params = [SamplingParams(seed=s, top_p=0.8, temperature=1.2) for s in range(6)]
    a, b = RequestGenerators(), RequestGenerators()
    # inverse-CDF sampling with one uniform per row from the row's own generator
    u = draw_uniforms([a.get(i, p.seed) for i, p in enumerate(params)], [1] * 6)
    plain = sample_from_probs(probs_from_params(logits, params), u)
    spec = verify(logits, [[]] * 6, params, [b.get(i, p.seed) for i, p in enumerate(params)])
    assert spec.flat_tokens.tolist() == plain.tolist() and spec.num_accepted.sum() == 0


def test_greedy_without_drafts_is_the_argmax() -> None:
    """The all-greedy, no-draft step (plain decoding) gives each row's first maximum, with ties,
    exactly as a batch with one draft in another row does for its zero-draft rows."""
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(5))
    logits[2, [3, 17]] = logits[2].max() + 1.0  # a tie: the first maximum wins
    out = RejectionSampler()(logits, torch.zeros(0, dtype=torch.long), torch.zeros(5, dtype=torch.long), None,
                             [GREEDY] * 5, [None] * 5)
    assert token_rows(out) == [[t] for t in logits.argmax(-1).tolist()] and token_rows(out)[2] == [3]
    assert out.num_tokens.tolist() == [1] * 5 and out.num_accepted.tolist() == [0] * 5
    # the general path (one row has a draft) agrees on the rows without drafts
    with_draft = torch.cat([logits[:1], logits[:1], logits[1:]])
    general = RejectionSampler()(with_draft, torch.tensor([0]), torch.tensor([1, 0, 0, 0, 0]), None,
                                 [GREEDY] * 5, [None] * 5)
    assert token_rows(general)[1:] == token_rows(out)[1:]
    with pytest.raises(ValueError):  # draft counts without draft tokens are still rejected
        RejectionSampler()(logits, torch.zeros(0, dtype=torch.long), torch.tensor([1, 0, 0, 0, 0]), None,
                           [GREEDY] * 5, [None] * 5)


def test_edge_cases_zero_probabilities() -> None:
    rows = 200
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]]).repeat(2, 1)
    pool = RequestGenerators()
    # p(draft) = 0 (filtered by top_k): always rejected, correction never the draft.
    params = [SamplingParams(top_k=2)] * rows
    out = verify(logits.repeat(rows, 1), [[3]] * rows, params, [pool.get(i) for i in range(rows)])
    assert out.num_accepted.sum() == 0 and all(t[0] in (0, 1) for t in token_rows(out))
    # q(draft) = 0: a token the drafter could not have produced is rejected.
    q = torch.tensor([[0.5, 0.5, 0.0, 0.0]]).repeat(rows, 1)
    out = verify(logits.repeat(rows, 1), [[2]] * rows, [SamplingParams()] * rows,
                 [pool.get(1000 + i) for i in range(rows)], draft_probs=q)
    assert out.num_accepted.sum() == 0
    # q == p: acceptance probability 1 everywhere; the residual is all zero and never used.
    p = probs_from_params(logits[:1], [SamplingParams()]).repeat(rows, 1)
    out = verify(logits.repeat(rows, 1), [[1]] * rows, [SamplingParams()] * rows,
                 [pool.get(2000 + i) for i in range(rows)], draft_probs=p)
    assert out.num_accepted.sum() == rows


def test_bad_shapes_rejected() -> None:
    with pytest.raises(ValueError):
        RejectionSampler()(torch.zeros(3, 4), torch.tensor([1]), [1], None, [GREEDY], [None])
    with pytest.raises(ValueError):
        RejectionSampler()(torch.zeros(2, 4), torch.tensor([1]), [1], torch.zeros(1, 5), [GREEDY], [None])


# ---------------------------------------------------------------- distribution preservation


def ref_process(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
    """Independent float64 reference of temperature -> top-k -> top-p -> min-p."""
    x = logits.astype(np.float64) / p.temperature
    probs = np.exp(x - x.max())
    probs /= probs.sum()
    if p.top_k != -1:
        probs[x < np.sort(x)[::-1][min(p.top_k, len(x)) - 1]] = 0
        probs /= probs.sum()
    if p.top_p < 1:
        order = np.argsort(-probs, kind="stable")
        before = np.cumsum(probs[order]) - probs[order]
        probs[order[before >= p.top_p]] = 0
        probs /= probs.sum()
    if p.min_p > 0:
        probs[probs < p.min_p * probs.max()] = 0
        probs /= probs.sum()
    return probs


def chisq(observed: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    """(statistic, dof) of counts against probs; mass on a zero-probability cell is fatal."""
    if observed[probs == 0].sum() > 0:
        return float("inf"), 1
    keep = probs > 0
    expected = observed.sum() * probs[keep]
    return float(((observed[keep] - expected) ** 2 / expected).sum()), int(keep.sum()) - 1


def pvalue(stat: float, dof: int) -> float:
    return 0.0 if not np.isfinite(stat) else float(stats.chi2.sf(stat, max(dof, 1)))


Verifier = Callable[..., RejectionOutput]  # RejectionSampler's call signature


def spec_trial(verifier: Verifier, params: SamplingParams, drafter: str, seed: int = 0) -> dict:
    """One verify step (k = 2 drafts) for N_TRIALS independent rows from the same context."""
    n, gen = N_TRIALS, torch.Generator().manual_seed(seed)
    p_table = probs_from_params(TARGET_TABLE, [params] * V)
    q_table = probs_from_params(DRAFT_TABLE, [params] * V)
    if drafter == "onehot":  # deterministic drafts that vary by row (some have p = 0)
        rows = torch.arange(n)
        x1, x2, draft_probs = rows % V, (rows * 3 + 1) % V, None
    else:  # drafts really sampled from q, which is passed along
        x1 = torch.multinomial(q_table[CONTEXT].expand(n, V), 1, generator=gen).squeeze(1)
        x2 = torch.multinomial(q_table[x1], 1, generator=gen).squeeze(1)
        draft_probs = torch.stack([q_table[CONTEXT].expand(n, V), q_table[x1]], 1).reshape(2 * n, V)
    logits = torch.stack([TARGET_TABLE[CONTEXT].expand(n, V), TARGET_TABLE[x1], TARGET_TABLE[x2]], 1)
    pool = RequestGenerators(engine_seed=seed)
    gens = [pool.get(i) for i in range(n)]
    out = verifier(logits.reshape(3 * n, V), torch.stack([x1, x2], 1).reshape(-1), [2] * n,
                   draft_probs, [params] * n, gens)
    first = np.array([t[0] for t in token_rows(out)])
    has_second = np.array([len(t) >= 2 for t in token_rows(out)])
    second = np.array([t[1] if len(t) >= 2 else -1 for t in token_rows(out)])
    # End-to-end: where the step emitted one token, continue with the plain sampler.
    missing = np.flatnonzero(~has_second)
    if missing.size:
        cont = sample(TARGET_TABLE[torch.from_numpy(first[missing])], [params] * missing.size,
                      [gens[i] for i in missing])
        second_e2e = second.copy()
        second_e2e[missing] = cont.numpy()
    else:
        second_e2e = second
    return {"first": first, "second": second, "has_second": has_second, "second_e2e": second_e2e}


def distribution_pvalues(trial: dict, params: SamplingParams) -> dict[str, float]:
    p = np.stack([ref_process(TARGET_TABLE[i].numpy(), params) for i in range(V)])
    out = {"first": pvalue(*chisq(np.bincount(trial["first"], minlength=V), p[CONTEXT]))}
    # Second token given the first draft was accepted: p(. | first token), pooled over groups.
    stat, dof, used = 0.0, 0, 0
    for a in range(V):
        sel = trial["has_second"] & (trial["first"] == a)
        counts = np.bincount(trial["second"][sel], minlength=V)
        if sel.sum() * p[a][p[a] > 0].min() < 5:  # too few samples for chi-square cells
            stat += 0.0 if counts[p[a] == 0].sum() == 0 else float("inf")
            continue
        s, d_ = chisq(counts, p[a])
        stat, dof, used = stat + s, dof + d_, used + int(sel.sum())
    out["second_given_accept"] = pvalue(stat, dof)
    out["conditional_samples"] = used
    joint = np.bincount(trial["first"] * V + trial["second_e2e"], minlength=V * V)
    out["joint"] = pvalue(*chisq(joint, (p[CONTEXT][:, None] * p).reshape(-1)))
    return out


def pvalues_only(results: dict[str, float]) -> list[float]:
    return [v for name, v in results.items() if name != "conditional_samples"]


FILTERED = SamplingParams(temperature=0.7, top_k=5, top_p=0.9)
CASES = [(SamplingParams(), "onehot"), (SamplingParams(), "sampled"),
         (FILTERED, "onehot"), (FILTERED, "sampled"),
         (SamplingParams(temperature=1.3, min_p=0.1), "sampled")]


@pytest.mark.parametrize("params,drafter", CASES)
def test_distribution_preserved(params: SamplingParams, drafter: str) -> None:
    trial = spec_trial(RejectionSampler(), params, drafter)
    pvals = distribution_pvalues(trial, params)
    assert min(pvalues_only(pvals)) > 1e-3, pvals
    # the conditional check must actually have data (accepted first drafts)
    assert pvals["conditional_samples"] >= 2000, pvals
    assert 0 < trial["has_second"].mean() < 1  # both outcomes happen


# ---------------------------------------------------------------- the test has teeth


def rows_output(rows: list[list[int]]) -> RejectionOutput:
    """A broken verifier's rows as the rejection sampler's output."""
    num_tokens = torch.tensor([len(r) for r in rows])
    return RejectionOutput(torch.tensor([t for r in rows for t in r]), num_tokens, num_tokens - 1)


def accept_always(logits, drafts, counts, draft_probs, params, gens):
    """Broken: commits every draft (first token then follows q, not p)."""
    n, k = len(counts), counts[0]
    return rows_output(drafts.reshape(n, k).tolist())


def greedy_verify(logits, drafts, counts, draft_probs, params, gens):
    """Broken: greedy verification applied to sampled requests."""
    return RejectionSampler()(logits, drafts, counts, None, [GREEDY] * len(counts), [None] * len(counts))


def resample_from_p(logits, drafts, counts, draft_probs, params, gens):
    """Broken subtly: right acceptance test, but a rejection resamples from p, not the residual."""
    n, k = len(counts), counts[0]
    p = probs_from_params(logits, params[:1] * logits.shape[0]).reshape(n, k + 1, -1)
    q = torch.nn.functional.one_hot(drafts, p.shape[-1]).float() if draft_probs is None else draft_probs
    x, q = drafts.reshape(n, k), q.reshape(n, k, -1)
    tokens = []
    for r in range(n):
        row = []
        for j in range(k + 1):
            u = torch.rand((), generator=gens[r])
            if j < k and u * q[r, j, x[r, j]] < p[r, j, x[r, j]]:
                row.append(int(x[r, j]))
                continue
            row.append(int(torch.multinomial(p[r, j], 1, generator=gens[r])))
            break
        tokens.append(row)
    return rows_output(tokens)


@pytest.mark.parametrize("broken", [accept_always, greedy_verify, resample_from_p])
@pytest.mark.parametrize("drafter", ["onehot", "sampled"])
def test_distribution_check_catches_broken_verifiers(broken: Verifier, drafter: str) -> None:
    params = SamplingParams()
    pvals = distribution_pvalues(spec_trial(broken, params, drafter), params)
    assert min(pvalues_only(pvals)) < 1e-6, pvals


def test_random_rows_independent_of_batch() -> None:
    gen = torch.Generator().manual_seed(8)
    counts = [2, 0, 3, 1]
    logits = torch.randn(sum(counts) + 4, 12, generator=gen)
    drafts = [[1, 2], [], [3, 4, 5], [6]]
    q = torch.softmax(torch.randn(sum(counts), 12, generator=gen), -1)
    params = [SamplingParams(seed=s, top_k=6) for s in range(3)] + [GREEDY]
    pool = RequestGenerators()
    gens = [pool.get(i, p.seed) if i < 3 else None for i, p in enumerate(params)]
    batch = verify(logits, drafts, params, gens, q)
    alone = verify(logits[4:8], [drafts[2]], [params[2]], [RequestGenerators().get(2, 2)], q[2:5])
    assert token_rows(batch)[2] == token_rows(alone)[0]


# ---------------------------------------------------------------- non-finite logits (issue 18)


def _verify_rows_with_a_rejection(greedy: bool) -> tuple[torch.Tensor, list[list[int]], list[SamplingParams]]:
    """Two verify rows over V = 20. Row 0 (4 drafts, positions 0..4): drafts 0 and 1 are accepted,
    draft 2 (judged by position 2) is rejected, so its tokens come from positions 0, 1 and 2 and
    positions 3 and 4 give none. Row 1 (2 drafts, positions 5..7) is clean. The logits are peaked
    (+-30) so a sampled row accepts and rejects exactly the same drafts."""
    v = 20
    logits = torch.zeros(5 + 3, v)
    good = [3, 5, 7, 9, 11, 2, 4, 6]  # each position's favourite token
    logits[torch.arange(8), good] = 30.0
    drafts = [[3, 5, 8, 9], [2, 4]]  # row 0: draft 2 (8) is not position 2's favourite (7)
    logits[2, 8] = -30.0
    params = [GREEDY if greedy else SamplingParams(temperature=0.8, seed=11 + r) for r in range(2)]
    return logits, drafts, params


def _gens(params: list[SamplingParams]) -> list[torch.Generator | None]:
    pool = RequestGenerators()
    return [None if p.is_greedy else pool.get(i, p.seed) for i, p in enumerate(params)]


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("position", range(5))
def test_nonfinite_logits_before_vs_after_the_first_rejected_draft(greedy: bool, value: float,
                                                                   position: int) -> None:
    """A NaN / inf in row 0's logits at `position`: up to the first rejected draft's position (2)
    it gave one of the row's tokens, and first_nonfinite names that token (the tokens before it
    are the clean run's); after it (3, 4) no token came from it: nothing is reported and every
    token is the clean run's. The clean row is never touched."""
    logits, drafts, params = _verify_rows_with_a_rejection(greedy)
    clean = verify(logits, drafts, params, _gens(params))
    assert token_rows(clean) == [[3, 5, 7], [2, 4, 6]] and clean.first_nonfinite.tolist() == [-1, -1]
    poisoned = logits.clone()
    poisoned[position, 13] = value
    out = verify(poisoned, drafts, params, _gens(params))
    rows = token_rows(out)
    assert rows[1] == [2, 4, 6]
    if position <= 2:
        assert out.first_nonfinite.tolist() == [position, -1]
        assert rows[0][:position] == [3, 5, 7][:position]
    else:
        assert out.first_nonfinite.tolist() == [-1, -1]
        assert rows[0] == [3, 5, 7]


def test_nonfinite_logits_without_drafts() -> None:
    """Plain steps (the all-greedy fast path, and a batch with a sampled row): a row with a NaN or
    an inf anywhere reports its token (0); finite rows report -1 and keep their tokens."""
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(9))
    logits[1, 7] = float("nan")
    logits[3, 0] = float("-inf")
    none = torch.zeros(0, dtype=torch.long)
    fast = RejectionSampler()(logits, none, torch.zeros(4, dtype=torch.long), None, [GREEDY] * 4, [None] * 4)
    assert fast.first_nonfinite.tolist() == [-1, 0, -1, 0]
    assert [fast.flat_tokens[i].item() for i in (0, 2)] == [logits[0].argmax().item(), logits[2].argmax().item()]
    params = [GREEDY, SamplingParams(seed=1), SamplingParams(seed=2), GREEDY]
    mixed = RejectionSampler()(logits, none, torch.zeros(4, dtype=torch.long), None, params, _gens(params))
    assert mixed.first_nonfinite.tolist() == [-1, 0, -1, 0]
    alone = RejectionSampler()(logits[2:3], none, torch.zeros(1, dtype=torch.long), None, [params[2]],
                               [RequestGenerators().get(2, 2)])
    assert mixed.flat_tokens[2].item() == alone.flat_tokens[0].item()
