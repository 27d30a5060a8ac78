"""Issue 18: NaN or inf logits end that request with an error naming it ("request <id>: non-finite
logits at output position N"), checked inside sampling; the other requests run on.

Before, a NaN weight gave silent garbage: greedy argmax over NaN logits emitted token 0 forever.
These tests poison the default SmolLM2 (float32, CPU):
  - a token's embedding (the regression): every forward that reads that token as an input (in the
    prompt, or once the request has generated it) gives NaN hidden states, so the logits of that
    position and every one after it are NaN; requests that never read the token are untouched;
  - one request's logits from a position on, at the forward's output: that puts the first NaN
    logits in the middle of a speculative verify row (a poisoned token cannot get there: ngram
    drafts only tokens the request has already read).
The other requests (plain decoding, ngram speculation, seeded sampling, stop strings) must give
exactly what they give without the poison.
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Iterator

import pytest
import torch

from pyengine import LLM, SamplingParams
from pyengine.models.llama import PackedColumns
from pyengine.outputs import RequestOutput

MAX_TOKENS = 12
PROMPT_A = "The capital of France is"  # the request that is poisoned
PROMPT_B = "Count from one to ten:"  # the one that must run on
REPEAT = "one, two, three, one, two, three, one, two, three, one, two,"  # ngram drafts get accepted
NGRAM = {"method": "ngram", "num_speculative_tokens": 4}

MODES = {  # name: (speculative?, SamplingParams of the poisoned request and of the other one)
    "greedy": (False, dict(temperature=0)),
    "greedy_ngram": (True, dict(temperature=0)),
    "sampled": (False, dict(temperature=0.8, seed=7)),
    "stop_strings": (False, dict(temperature=0, stop=["never said"])),  # a streamed request
}


@pytest.fixture(scope="module")
def plain() -> LLM:
    return LLM(dtype="float32")


@pytest.fixture(scope="module")
def ngram() -> LLM:
    return LLM(dtype="float32", speculative_config=NGRAM)


@pytest.fixture(scope="module")
def ngram_k4() -> LLM:
    """Always 4 drafts where ngram finds them (the adaptive draft length learns from earlier runs)."""
    return LLM(dtype="float32", speculative_config={**NGRAM, "adaptive_draft_length": False})


def llm_for(mode: str, plain: LLM, ngram: LLM) -> LLM:
    return ngram if MODES[mode][0] else plain


def params(mode: str, max_tokens: int = MAX_TOKENS, seed_offset: int = 0) -> SamplingParams:
    kw = dict(MODES[mode][1])
    if "seed" in kw:
        kw["seed"] += seed_offset
    return SamplingParams(max_tokens=max_tokens, **kw)


@contextmanager
def nan_embedding(llm: LLM, token: int) -> Iterator[None]:
    """NaN into what the forward reads as `token`'s embedding. The tied SmolLM2 keeps no embedding
    table: a token's embedding is lm_head's dense column (LlamaForCausalLM.forward), while the
    logits come from the packed copy that prepack_for_cpu made. Where nothing was packed the logits
    read the dense lm_head too: give them a copy of their own first, so only the embedding is
    poisoned."""
    m = llm.model
    if m.embed_tokens is not None:
        table, index = m.embed_tokens, (token,)
    elif isinstance(m.embedding_columns, PackedColumns):  # rows read from the packed lm_head (GGUF on the CPU)
        columns, gather = m.embedding_columns, m.embedding_columns.gather
        columns.gather = lambda ids: gather(ids).masked_fill((ids == token)[:, None], float("nan"))
        try:
            yield
        finally:
            del columns.gather
        return
    elif m.embedding_columns is not None:  # the tied table kept as int8 codes + scales
        table, index = m.embedding_columns.scales, (..., token)
    else:
        if m.packed_lm_head is None:
            m.packed_lm_head = m.lm_head.detach().clone()
        table, index = m.lm_head, (slice(None), token)
    with torch.no_grad():
        saved = table[index].clone()
        table[index] = float("nan")
        try:
            yield
        finally:
            table[index] = saved


@contextmanager
def patched(obj, name: str, value) -> Iterator[None]:
    """obj.name = value for the block (an instance attribute over the class's method)."""
    own = vars(obj).get(name, patched)
    setattr(obj, name, value)
    try:
        yield
    finally:
        if own is patched:
            delattr(obj, name)
        else:
            setattr(obj, name, own)


@contextmanager
def nan_logits_from(llm: LLM, seq_id_of, position: int) -> Iterator[None]:
    """Every logits row of request seq_id_of() whose input sits at `position` or later comes out of
    the forward NaN (what a poisoned KV entry at `position` does), whatever the kernels make of NaN."""
    runner = llm.engine.runner
    execute = runner.execute

    def poisoned(batch):
        logits = execute(batch).clone()
        qsl, nl = batch.query_start_loc, batch.num_logits
        first = 0
        for r in range(batch.num_rows):
            if int(batch.seq_ids[r]) == seq_id_of():
                rows = range(first, first + int(nl[r]))
                tokens = range(int(qsl[r + 1]) - int(nl[r]), int(qsl[r + 1]))  # the inputs they follow
                for i, t in zip(rows, tokens):
                    if int(batch.positions[t]) >= position:
                        logits[i] = float("nan")
            first += int(nl[r])
        return logits

    with patched(runner, "execute", poisoned):
        yield


@contextmanager
def watch(llm: LLM) -> Iterator[dict]:
    """Independent evidence, outside the sampler: did a forward give non-finite logits, and which
    rows did the engine report (hold_back_nonfinite's first_bad per step)?"""
    eng = llm.engine
    seen: dict = {"nonfinite_forwards": 0, "first_bad": []}
    execute, hold = eng.runner.execute, getattr(eng.outputs, "hold_back_nonfinite", None)

    def spy_execute(batch):
        logits = execute(batch)
        seen["nonfinite_forwards"] += int(not torch.isfinite(logits).all())
        return logits

    def spy_hold(batch, tokens, counts, first_bad):
        seen["first_bad"].append((batch.seq_ids.tolist(), batch.num_draft_tokens.tolist(), first_bad.tolist()))
        return hold(batch, tokens, counts, first_bad)

    # (without hold_back_nonfinite, an engine from before the fix, the tests fail on their asserts)
    spy = nullcontext() if hold is None else patched(eng.outputs, "hold_back_nonfinite", spy_hold)
    with patched(eng.runner, "execute", spy_execute), spy:
        yield seen


def run(llm: LLM, prompts: list[list[int]], sp: list[SamplingParams]) -> list[RequestOutput]:
    return llm.generate(prompts, sp, use_tqdm=False)


def assert_error(out: RequestOutput, position: int, token_ids: list[int]) -> None:
    c = out.outputs[0]
    assert (c.finish_reason, out.error) == (
        "error", f"request {out.request_id}: non-finite logits at output position {position}")
    assert c.token_ids == token_ids


def assert_same(out: RequestOutput, ref: RequestOutput) -> None:
    assert out.error is None and ref.error is None
    assert (out.outputs[0].token_ids, out.outputs[0].finish_reason, out.outputs[0].text) == \
        (ref.outputs[0].token_ids, ref.outputs[0].finish_reason, ref.outputs[0].text)


# ---- the regression test -------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", list(MODES))
def test_regression_nan_weight_ends_the_request_with_an_error(mode: str, plain: LLM, ngram: LLM) -> None:
    """A NaN embedding row of a token in request A's prompt: A ends at once (output position 0,
    no tokens) with the error; B, in the same batch, gives exactly the tokens it gives alone.
    Before the fix A 'finished' with MAX_TOKENS garbage tokens and no error."""
    llm = llm_for(mode, plain, ngram)
    tok = llm.tokenizer
    a, b = tok.encode(PROMPT_A), tok.encode(PROMPT_B)
    pa, pb = params(mode), params(mode, seed_offset=1)
    alone_b = run(llm, [b], [pb])[0]
    token = next(t for t in reversed(a) if t not in b and t not in alone_b.outputs[0].token_ids)
    with nan_embedding(llm, token), watch(llm) as seen:
        out_a, out_b = run(llm, [a, b], [pa, pb])
    assert seen["nonfinite_forwards"] >= 1  # the poison reached the logits
    assert_error(out_a, 0, [])
    assert_same(out_b, alone_b)
    # and with the poison gone the model is as before
    assert_same(run(llm, [b], [pb])[0], alone_b)


@pytest.mark.parametrize("mode", list(MODES))
def test_nan_after_a_generated_token(mode: str, plain: LLM, ngram: LLM) -> None:
    """Poison the token A generates at output position m (its first appearance, in neither prompt
    nor B's output): A keeps its first m + 1 tokens (the poisoned token was produced by finite
    logits) and ends at output position m + 1, the first that reads it; B runs on."""
    llm = llm_for(mode, plain, ngram)
    tok = llm.tokenizer
    a, b = tok.encode(PROMPT_A), tok.encode(PROMPT_B)
    pa, pb = params(mode), params(mode, seed_offset=1)
    ref_a, ref_b = run(llm, [a], [pa])[0], run(llm, [b], [pb])[0]
    out = ref_a.outputs[0].token_ids
    assert len(out) == MAX_TOKENS, "the reference should run to its length limit"
    m = next(i for i in range(2, MAX_TOKENS - 2)
             if out[i] not in out[:i] and out[i] not in a and out[i] not in b and out[i] not in ref_b.outputs[0].token_ids)
    with nan_embedding(llm, out[m]):
        out_a, out_b = run(llm, [a, b], [pa, pb])
        assert_error(out_a, m + 1, out[:m + 1])
        assert_same(out_b, ref_b)
        # the poisoned token as the very last one (max_tokens = m + 1): nothing reads it, no error
        (last,) = run(llm, [a], [params(mode, max_tokens=m + 1)])
        assert (last.error, last.outputs[0].finish_reason, last.outputs[0].token_ids) == (None, "length", out[:m + 1])


@pytest.mark.parametrize("mode", ["greedy", "stop_strings"])
def test_poisoned_prompt_with_one_token_to_go(mode: str, plain: LLM) -> None:
    """max_tokens 1: the scheduler commits one token per prefill row, so the bad row commits a
    filler that finishes the request by length; the filler is not output and the error stands."""
    a = plain.tokenizer.encode(PROMPT_A)
    with nan_embedding(plain, a[-1]):
        (out,) = run(plain, [a], [params(mode, max_tokens=1)])
    assert_error(out, 0, [])


def test_nan_in_the_middle_of_a_verify_row(plain: LLM, ngram_k4: LLM) -> None:
    """The first NaN logits inside a verify row, after accepted drafts: the row commits the tokens
    before that position (the drafts it accepted there) and the request ends at it, exactly where
    plain decoding ends; the NaN logits after it (and after a rejected draft) never count. Request
    A's logits are NaN from one position on (the forward's output is poisoned: no kernel can hide
    it), for several positions in turn; at least one must fall inside a verify row."""
    tok = plain.tokenizer
    a, b = tok.encode(REPEAT), tok.encode(PROMPT_B)
    pa, pb = SamplingParams(temperature=0, max_tokens=16), SamplingParams(temperature=0, max_tokens=16)
    ref_a, ref_b = run(plain, [a, b], [pa, pb])
    mid_row = 0
    for offset in range(2, 10):  # the logits after the input at len(a) + offset give output offset + 1
        for llm in (plain, ngram_k4):
            first_id = llm.engine.next_id  # A is added first
            with nan_logits_from(llm, lambda: first_id, len(a) + offset), watch(llm) as seen:
                out_a, out_b = run(llm, [a, b], [pa, pb])
            assert out_a.request_id == first_id
            assert_error(out_a, offset + 1, ref_a.outputs[0].token_ids[:offset + 1])
            assert_same(out_b, ref_b)
            rows = [(d[ids.index(first_id)], f[ids.index(first_id)]) for ids, d, f in seen["first_bad"] if first_id in ids]
            assert len(rows) == 1 and rows[0][1] >= 0  # one step reported A, and only A
            assert all(f == -1 for ids, _, fs in seen["first_bad"] for i, f in zip(ids, fs) if i != first_id)
            mid_row += llm is ngram_k4 and rows[0][0] > 0 and rows[0][1] > 0
    assert mid_row, "no poisoned position fell inside a verify row"
    assert ngram_k4.stats()["num_accepted_tokens"] > 0


def expected_under_poison(prompt: list[int], ref: RequestOutput, token: int, max_tokens: int) -> tuple:
    """What a request gives once `token`'s embedding is NaN, from its clean output `ref`: an error
    at output 0 if its prompt holds the token, else at the output after its first generation of it
    (unless that was its last token), else the clean output."""
    out = ref.outputs[0].token_ids
    if token in prompt:
        return [], "error", f"request {{}}: non-finite logits at output position 0"
    if token in out[:max_tokens - 1]:
        n = out.index(token) + 1
        return out[:n], "error", f"request {{}}: non-finite logits at output position {n}"
    return out, ref.outputs[0].finish_reason, None


def test_async_decode_drops_the_step_launched_ahead(tmp_path) -> None:
    """Async decode, run on the CPU through the graph runner as tests/test_async_decode.py does: a
    step whose greedy rows are all decode rows launches the next step before its tokens are on the
    host, feeding it this step's argmax. When a row of the step that used such a forward has NaN
    logits, the forward it launched in turn (run on that row's garbage token) is dropped, the row's
    request ends with the error, and every request gives what the synchronous engine gives, which
    is what the clean outputs predict."""
    from tests.test_async_decode import make_llm
    from tests.test_spec_decode import make_prompts
    from tests.tiny_models import make_checkpoint

    make_checkpoint("llama_gqa_untied", str(tmp_path))
    prompts = make_prompts(5)
    max_tokens = 24
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    # no prefix caching: a poisoned run would take the clean run's cached KV of a prompt's blocks
    kw = dict(max_num_seqs=8, enable_prefix_caching=False)
    sync, ahead = make_llm(str(tmp_path), False, **kw), make_llm(str(tmp_path), True, **kw)
    clean = run(sync, prompts, [sp] * 5)
    token = next(t for t in clean[0].outputs[0].token_ids[3:] if t not in prompts[0])
    got = {}
    for name, llm in (("sync", sync), ("async", ahead)):
        first_id = llm.engine.next_id
        with nan_embedding(llm, token):
            outs = run(llm, prompts, [sp] * 5)
        got[name] = [(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.error) for o in outs]
        want = [expected_under_poison(p, r, token, max_tokens) for p, r in zip(prompts, clean)]
        assert got[name] == [(t, f, e and e.format(first_id + i)) for i, (t, f, e) in enumerate(want)], name
    assert any(f == "error" for _, f, _ in got["sync"]) and any(f != "error" for _, f, _ in got["sync"])
    assert ahead.engine.num_async_steps > 0 and ahead.engine.num_async_discarded > 0
