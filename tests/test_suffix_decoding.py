"""Suffix decoding (method "suffix", csrc/core/suffix_proposer.h): what it drafts from a request's
own tokens and from finished requests, its caps, its settings, and losslessness on the default
model (greedy tokens and logits equal plain decoding; it accepts more than prompt lookup where an
answer repeats an earlier request's)."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from pyengine import LLM, SamplingParams, _C
from pyengine.spec_decode.config import SpeculativeConfig


def test_drafts_continue_the_longest_recurring_context() -> None:
    p = _C.SuffixProposer(max_depth=8, max_spec_factor=4.0, min_token_prob=0.1)
    tokens = [1, 2, 3, 4, 5, 9, 9, 1, 2, 3]
    assert p.propose_tokens(0, tokens, 3) == [4, 5, 9]  # after "1 2 3" came "4 5 9"
    # "3" alone is followed by 4 once; the longer context "2 3" wins (same here) - the chain goes on
    # through drafted tokens: "... 1 2 3 4" -> 5 -> 9 -> 9 -> 1
    assert p.propose_tokens(0, tokens, 6) == [4, 5, 9, 9, 1, 2]


def test_the_most_frequent_continuation_and_the_confidence_cut() -> None:
    p = _C.SuffixProposer(max_depth=4, max_spec_factor=8.0, min_token_prob=0.5)
    # after 7 came 1 twice and 2 once: 1 is drafted (2/3 >= 0.5), then after "7 1" came 5, 6 (1 each: 1/2)
    assert p.propose_tokens(0, [7, 1, 5, 7, 2, 0, 7, 1, 6, 7], 4)[:1] == [1]
    strict = _C.SuffixProposer(max_depth=4, max_spec_factor=8.0, min_token_prob=0.9)
    assert strict.propose_tokens(0, [7, 1, 5, 7, 2, 0, 7, 1, 6, 7], 4) == []  # 1 follows 7 only 2/3 of the time


def test_draft_length_is_capped_by_the_match_length() -> None:
    p = _C.SuffixProposer(max_depth=16, max_spec_factor=1.0, min_token_prob=0.0)
    tokens = [10, 11, 12, 13, 14, 15, 16, 17, 50, 12]
    assert len(p.propose_tokens(0, tokens, 8)) == 1  # matched "12" only: one draft
    tokens = [10, 11, 12, 13, 14, 15, 16, 17, 50, 10, 11, 12]
    assert p.propose_tokens(1, tokens, 8) == [13, 14, 15]  # matched 3 tokens: three drafts


def test_finished_requests_feed_other_requests_and_the_cache_is_bounded() -> None:
    p = _C.SuffixProposer(max_depth=8, max_spec_factor=4.0, min_token_prob=0.1, max_cached_tokens=12)
    answer = [40, 41, 42, 43, 44, 45, 46, 47]
    assert p.propose_tokens(0, [1, 2] + answer, 2, prompt_len=2) == []  # nothing repeats inside request 0
    p.forget(0, True)
    assert p.num_cached_tokens == 8  # its output: more than half the cache, now the older generation
    assert p.propose_tokens(1, [7, 7, 40, 41], 3) == [42, 43, 44]  # request 0's answer
    p.forget(2, False)  # unknown / preempted: nothing happens
    assert p.propose_tokens(3, [90, 91, 92, 93, 94, 95, 96, 97], 1) == []
    p.forget(3, True)  # another 8 tokens: request 0's generation is dropped
    assert p.num_cached_tokens == 8
    assert p.propose_tokens(4, [40, 41], 3) == []
    assert p.propose_tokens(5, [93, 94], 2) == [95, 96]


@pytest.mark.parametrize("bad,match", [
    ({"suffix_decoding_max_tree_depth": 0}, "suffix_decoding_max_tree_depth must be an int"),
    ({"suffix_decoding_min_token_prob": 1.5}, "suffix_decoding_min_token_prob must be a number"),
    ({"suffix_decoding_max_spec_factor": "x"}, "suffix_decoding_max_spec_factor must be a number"),
])
def test_bad_suffix_settings(bad: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig.from_dict({"method": "suffix", "num_speculative_tokens": 4, **bad})
    with pytest.raises(ValueError, match="apply to method 'suffix' only"):
        SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4, "suffix_decoding_max_tree_depth": 8})


def test_the_lookups_shortest_match_follows_the_device_unless_set() -> None:
    """ngram's lookup and suffix's stand-in one (steps built on the device) start at one matched
    token on CUDA and at two elsewhere, unless the user bounds them."""
    for method in ("ngram", "suffix"):
        cfg = SpeculativeConfig.from_dict({"method": method, "num_speculative_tokens": 4})
        assert (cfg.lookup_min("cuda"), cfg.lookup_min("cpu"), cfg.prompt_lookup_max) == (1, 2, 4)
        one = SpeculativeConfig.from_dict({"method": method, "num_speculative_tokens": 4, "prompt_lookup_max": 1})
        assert (one.lookup_min("cuda"), one.lookup_min("cpu")) == (1, 1)
        set_ = SpeculativeConfig.from_dict({"method": method, "num_speculative_tokens": 4, "prompt_lookup_min": 3,
                                            "prompt_lookup_max": 6})
        assert (set_.lookup_min("cuda"), set_.lookup_min("cpu"), set_.prompt_lookup_max) == (3, 3, 6)
        with pytest.raises(ValueError, match="prompt_lookup_min <= prompt_lookup_max"):
            SpeculativeConfig.from_dict({"method": method, "num_speculative_tokens": 4, "prompt_lookup_min": 5})


def test_suffix_decoding_is_lossless_and_learns_from_finished_requests(smollm2_path: str) -> None:
    """The same question asked again (a retry, an agent loop): suffix decoding drafts the earlier
    answer; greedy tokens equal plain decoding (the logits: the checker test below)."""
    question = [{"role": "user", "content": "List the first ten prime numbers, comma separated."}]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    plain = LLM(smollm2_path, device="cpu", seed=0)
    plain.engine.cfg.record_logits = True
    first = plain.chat(question, params, use_tqdm=False)[0].outputs[0].token_ids

    def run(method: str) -> tuple[list[list[int]], dict]:
        llm = LLM(smollm2_path, device="cpu", seed=0,
                  speculative_config={"method": method, "num_speculative_tokens": 4, "adaptive_draft_length": False})
        outs = [llm.chat(question, params, use_tqdm=False)[0].outputs[0].token_ids for _ in range(2)]
        return outs, llm.stats()

    suffix_outs, suffix_stats = run("suffix")
    ngram_outs, ngram_stats = run("ngram")
    assert suffix_outs == [first, first] == ngram_outs
    # the second request's answer is drafted from the first's: nearly every draft accepted
    assert suffix_stats["num_accepted_tokens"] > ngram_stats["num_accepted_tokens"]
    assert suffix_stats["acceptance_rate"] > 0.5


def test_suffix_spec_logits_equal_plain_through_the_checker(smollm2_path: str) -> None:
    from pyengine.check import check_losslessness
    from tests.test_spec_bits_cpu import PROMPTS, assert_bit_identical

    spec = {"method": "suffix", "num_speculative_tokens": 4, "adaptive_draft_length": False}
    report = check_losslessness(PROMPTS, model=smollm2_path, device="cpu", dtype="bfloat16", speculative_config=spec,
                                max_tokens=20, alone=False, chat=False, batch_invariant=True)
    assert_bit_identical(report, "spec")


def test_random_sampling_with_suffix_drafts_keeps_the_target_distribution(tmp_path) -> None:
    from tests.spec_harness import check_second_token_follows_target
    from tests.tiny_models import make_checkpoint

    make_checkpoint("llama_gqa_untied", str(tmp_path))
    # every token 3..95 once, each followed by the next: whatever the first sampled token, the
    # context ending in it recurs, and the first verify step carries drafts
    prompt = list(range(3, 96)) + [5]
    spec = {"method": "suffix", "num_speculative_tokens": 3, "adaptive_draft_length": False,
            "suffix_decoding_max_spec_factor": 3.0, "suffix_decoding_min_token_prob": 0.0}
    check_second_token_follows_target(str(tmp_path), spec, prompt)


class ReferenceSuffixProposer:
    """The documented rule in plain Python (csrc/core/suffix_proposer.h, suffix_history.h), by brute
    force over token lists instead of context chains: the newest occurrences (at most 256) of the
    last two tokens, else of the last one, with their match lengths; the longest match over the
    request, the newer and the older cache generation (in that order on a tie); its most frequent
    continuation (the newest on a tie); the chain through the successors, searching again where
    none continues; the caps; finished outputs into two generations."""

    MAX_CANDIDATES = 256
    SEPARATOR = -1

    def __init__(self, max_depth: int, max_spec_factor: float, min_token_prob: float, max_cached_tokens: int) -> None:
        self.depth, self.factor, self.max_cached = max_depth, max_spec_factor, max_cached_tokens
        self.min_prob = np.float32(min_token_prob)  # compared in float32, as the C++ does
        self.requests: dict[int, tuple[list[int], int]] = {}
        self.recent: tuple[list[int], list[bool]] = ([], [])
        self.older: tuple[list[int], list[bool]] = ([], [])
        self.recent_tokens = self.older_tokens = 0

    def _search(self, source: tuple[list[int], list[bool]], ctx: list[int]) -> list[tuple[int, int]]:
        toks, occ = source

        def match(q: int, depth: int) -> int:
            m = 0
            while m < depth and m < len(ctx) and q - 1 - m >= 0 and toks[q - 1 - m] == ctx[-1 - m]:
                m += 1
            return m

        newest_first = [q for q in range(len(toks) - 1, -1, -1) if occ[q]]
        found: list[tuple[int, int]] = []
        if len(ctx) >= 2 and self.depth >= 2:
            found = [(q, match(q, self.depth)) for q in newest_first
                     if q >= 2 and toks[q - 2] == ctx[-2] and toks[q - 1] == ctx[-1]][:self.MAX_CANDIDATES]
        if not found:
            found = [(q, match(q, 1)) for q in newest_first if toks[q - 1] == ctx[-1]][:self.MAX_CANDIDATES]
        return found

    def propose(self, seq_id: int, tokens: list[int], k: int, prompt_len: int = 0) -> list[int]:
        mine, plen = self.requests.setdefault(seq_id, ([], prompt_len))
        mine.extend(tokens[len(mine):])
        if k <= 0 or not tokens:
            return []
        sources = [(mine, [q >= 1 for q in range(len(mine))]), self.recent, self.older]
        ctx = list(tokens[-self.depth:])
        found = [self._search(src, ctx) for src in sources]
        out: list[int] = []
        cap = k
        while len(out) < cap:
            best_len, best_src = 0, -1
            for s in range(3):
                for _, m in found[s]:
                    if m > best_len:
                        best_len, best_src = m, s
            if best_src < 0:
                break
            if not out:
                cap = min(k, max(1, int(self.factor * best_len)))
            nxt = [sources[best_src][0][q] for q, m in found[best_src] if m == best_len]  # newest first
            counts = Counter(nxt)
            top = max(counts.values())
            token = next(t for t in nxt if counts[t] == top)
            if np.float32(top) < self.min_prob * np.float32(len(nxt)):
                break
            out.append(token)
            ctx.append(token)
            for s, (toks, occ) in enumerate(sources):
                found[s] = [(q + 1, min(m + 1, self.depth)) for q, m in found[s]
                            if toks[q] == token and q + 1 < len(toks) and occ[q + 1]]
            if not any(found) and len(out) < cap:
                found = [self._search(src, ctx) for src in sources]
        return out

    def forget(self, seq_id: int, finished: bool) -> None:
        if seq_id not in self.requests or not finished:
            return
        mine, plen = self.requests.pop(seq_id)
        if self.max_cached <= 0 or len(mine) <= plen:
            return
        toks, occ = self.recent
        toks.append(self.SEPARATOR)
        occ.append(False)
        for p in range(max(0, plen - self.depth), len(mine)):
            q = len(toks)
            toks.append(mine[p])
            occ.append(p >= plen and q >= 1 and toks[q - 1] != self.SEPARATOR)
        self.recent_tokens += len(mine) - plen
        if self.recent_tokens > self.max_cached // 2:
            self.older, self.recent = self.recent, ([], [])
            self.older_tokens, self.recent_tokens = self.recent_tokens, 0


@pytest.mark.parametrize("seed", range(6))
def test_drafts_equal_the_reference_rule_on_random_traffic(seed: int) -> None:
    """Random requests over a small vocabulary (contexts recur at every length), growing by a few
    tokens between calls, some finishing into the shared cache: every call drafts exactly what
    the rule gives."""
    import random

    rng = random.Random(seed)
    settings = dict(max_depth=rng.choice([4, 8, 24]), max_spec_factor=rng.choice([0.5, 1.0, 4.0]),
                    min_token_prob=rng.choice([0.0, 0.1, 0.4]), max_cached_tokens=rng.choice([64, 4096]))
    vocab = rng.choice([2, 6])  # 2: a context's occurrences pass the 256 examined
    impl, ref = _C.SuffixProposer(**settings), ReferenceSuffixProposer(**settings)
    live: dict[int, tuple[list[int], int]] = {}
    next_id, calls = 0, 0
    for _ in range(400):
        if len(live) < 4 or rng.random() < 0.05:
            prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 30))]
            live[next_id] = (prompt, len(prompt))
            next_id += 1
        sid = rng.choice(list(live))
        tokens, plen = live[sid]
        k = rng.randint(0, 6)
        assert impl.propose_tokens(sid, tokens, k, prompt_len=plen) == ref.propose(sid, tokens, k, plen)
        calls += 1
        tokens.extend(rng.randrange(vocab) for _ in range(rng.randint(1, 4)))
        if rng.random() < 0.08:
            impl.forget(sid, True)
            ref.forget(sid, True)
            del live[sid]
    assert calls == 400 and impl.num_cached_tokens == ref.recent_tokens + ref.older_tokens
