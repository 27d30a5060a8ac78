"""MTP speculation (method "mtp") on a tiny DeepSeek-V3 with an MTP layer that agrees with the
target about half the time (tests/tiny_models.make_deepseek_checkpoint): greedy spec output equals
plain output bit for bit - tokens and every committed token's logits - at batch 1..16 with
heterogeneous prompts, k = 1..4, block sizes 1/16/64, prefix caching, mixed prefill/verify steps and
preemption; random sampling keeps the target distribution (chi-square)."""
from __future__ import annotations

import pytest

from tests.spec_harness import check_second_token_follows_target, plain_greedy, run, spec_equals_plain

from tests.tiny_models import make_deepseek_checkpoint, make_prompts

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("dsv3_mtp"))
    make_deepseek_checkpoint(path, mtp_agreement=0.01, layer_scale=0.02)
    return path


def _spec_equals_plain(path: str, batch: int, k: int, block_size: int, prefix: bool, **kw):
    spec = {"method": "mtp", "num_speculative_tokens": k, "adaptive_draft_length": False}
    kw.setdefault("max_num_batched_tokens", 64)  # prompts admitted over several steps: prefix hits, mixed steps
    st, rec = spec_equals_plain(path, spec, batch, MAX_TOKENS, block_size=block_size, enable_prefix_caching=prefix, **kw)
    assert st["num_draft_tokens"] > 0 and 0 < st["acceptance_rate"] < 1, st
    return st, rec


# Pairwise cover: every batch {1, 8, 16}, k {1..4}, block size {1, 16, 64} and prefix on/off.
@pytest.mark.parametrize("batch,k,block_size,prefix", [
    (1, 1, 16, True), (1, 4, 1, False), (8, 2, 64, True), (8, 3, 1, True), (16, 4, 16, False), (16, 1, 64, False),
    (8, 4, 16, True), (1, 3, 64, True), (16, 2, 1, True),
])
def test_greedy_mtp_equals_plain(target: str, batch: int, k: int, block_size: int, prefix: bool) -> None:
    st, rec = _spec_equals_plain(target, batch, k, block_size, prefix)
    if k > 1:  # partial acceptance: some verify rows keep fewer drafts than they carried, some all
        rows = rec.verify_rows()
        assert any(c - 1 < d for _, _, d, c in rows) and any(c - 1 == d for _, _, d, c in rows)
    if batch > 1:
        assert rec.had_mixed_step(), "no step verified drafts next to a prefill"


def test_preemption_and_tiny_token_budget(target: str) -> None:
    """Few KV blocks force preemption (re-prefill, the MTP state forgotten); a token budget of 16
    trims drafts (ragged rows)."""
    st, rec = _spec_equals_plain(target, 8, 3, 4, True, num_kv_blocks=40, max_num_batched_tokens=16)
    assert st["num_preemptions"] > 0 and rec.had_ragged_step()


def test_mtp_with_adaptive_draft_length(target: str) -> None:
    prompts = make_prompts(8)
    outs = run(target, prompts, max_tokens=MAX_TOKENS, spec={"method": "mtp", "num_speculative_tokens": 3})[0]
    assert [tuple(o) for o in outs] == list(plain_greedy(target, 8, MAX_TOKENS)[0])


def test_random_sampling_keeps_target_distribution(target: str) -> None:
    st = check_second_token_follows_target(target, {"method": "mtp", "num_speculative_tokens": 2,
                                                    "adaptive_draft_length": False}, [5, 17, 3, 88, 41, 9])
    assert 0.05 < st["acceptance_rate"] < 0.95, st


@pytest.mark.parametrize("period", [3, 7])
def test_mtp_steps_launched_ahead_keep_the_layers_hidden_states(target: str, period: int) -> None:
    """Async decode with the target's own MTP layer (the graph runner's padded path on the CPU, where
    a launch computes at once): a step launched ahead and used leaves its final hidden states for
    the layer's next catch-up (ModelRunner.adopt_launched); without them the layer would skip it.
    Same drafts, accepted the same, as without async decode (every stat equal), and plain
    decoding's tokens. (On the CPU the padded path returns fresh hidden tensors, so the copy made
    before a launch, hold_hidden, is checked by the EAGLE-3 test, whose aux buffer is fixed.)"""
    from tests.test_async_decode import drafting_async_equals_sync

    drafting_async_equals_sync(target, {"method": "mtp", "num_speculative_tokens": 3}, period, 24)
