"""The CUDA Gated DeltaNet kernel (hipkernels/ssm/gated_delta_rule.hip) against the PyTorch
reference (pyengine/ops/reference/gdn.py): outputs and committed states (base + replayed records,
materialised) over multi-step acceptance sequences with every acceptance length, PAD rows, grouped
heads, partial record tiles, fp32 and bf16; verify rows over several steps equal the same tokens
decoded one by one, bit for bit, and a row's bits do not depend on its neighbours; prefill rows
(final state only, from base + records) against the chunked form; the model's prefill entry takes the
chunk-wise kernel by default and the recurrence under batch_invariant. Qwen3-Next end to end with MTP
and with the chunk-wise prefill against the recurrence. Skips without CUDA."""
from __future__ import annotations

import gc

import pytest
import torch

from pyengine import LLM, SamplingParams
from pyengine.ops import reference
from pyengine.ops.cuda import gdn as cuda_gdn

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

try:
    from pyengine.ops import cuda as cuda_ops
except ImportError:
    cuda_ops = None


def inputs(ntok: int, h: int, hv: int, dk: int, dv: int, dtype: torch.dtype, seed: int = 0) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen, device="cuda")  # noqa: E731
    return {"q": rnd(ntok, h, dk).to(dtype), "k": rnd(ntok, h, dk).to(dtype), "v": rnd(ntok, hv, dv).to(dtype),
            "g": -torch.nn.functional.softplus(rnd(ntok, hv)) * 0.5, "beta": torch.sigmoid(rnd(ntok, hv))}


def i32(x) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.int32, device="cuda")


def qsl(lengths: list[int]) -> torch.Tensor:
    return i32([0] + lengths).cumsum(0).to(torch.int32)


def run_update(fn, x: dict, state: torch.Tensor, lengths, idx, acc) -> torch.Tensor:
    return fn(x["q"], x["k"], x["v"], x["g"], x["beta"], state, qsl(lengths), i32(idx), i32(acc))


needs_kernels = pytest.mark.skipif(cuda_ops is None, reason="built without GPU kernels")


def materialised(fn, state: torch.Tensor, row: list[int], a: int) -> torch.Tensor:
    """The full state a row committed (base + a - 1 records), materialised by fn into a scratch copy."""
    scratch = torch.cat([state, state[:1]])
    fn(scratch, i32([row]), i32([a]), i32([state.shape[0]]))
    return scratch[-1]


SHAPES = [(2, 4, 16, 24), (16, 32, 128, 128), (1, 2, 256, 64), (2, 6, 64, 72)]


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("h,hv,dk,dv", SHAPES)
def test_update_matches_reference_over_steps(dtype: torch.dtype, h: int, hv: int, dk: int, dv: int) -> None:
    """Steps of rows with 1..4 tokens and every acceptance length, a PAD row, grouped heads, a partial
    record tile: outputs and committed states (materialised) against the reference's."""
    idx = [[0, 1, 2, 3], [4, 5, 6, 7], [-1, -1, -1, -1], [8, 9, 10, 11], [12, 13, 14, 15]]
    base = torch.randn(16, hv, dv, dk, device="cuda") * 0.5
    got_state, ref_state = base.clone(), base.clone()
    acc = [1] * 5
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    for step, lengths in enumerate([[1, 4, 2, 3, 4], [4, 4, 1, 2, 3], [2, 3, 4, 4, 1]]):
        x = inputs(sum(lengths), h, hv, dk, dv, dtype, seed=step)
        got = run_update(cuda_ops.gated_delta_rule_update, x, got_state, lengths, idx, acc)
        ref = run_update(reference.gated_delta_rule_update, x, ref_state, lengths, idx, acc)
        torch.testing.assert_close(got.float(), ref.float(), atol=tol * 4, rtol=tol)
        pad = sum(lengths[:2])
        assert (got[pad:pad + lengths[2]] == 0).all()  # the PAD row
        acc = [1 + (step + n) % q for n, q in enumerate(lengths)]
        for n, row in enumerate(idx):
            if row[0] >= 0:
                torch.testing.assert_close(materialised(cuda_ops.gated_delta_rule_materialise, got_state, row, acc[n]),
                                           materialised(reference.gated_delta_rule_materialise, ref_state, row,
                                                        acc[n]), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got_state[[0, 4, 8, 12]], ref_state[[0, 4, 8, 12]], atol=1e-4, rtol=1e-4)  # bases


@needs_kernels
@pytest.mark.parametrize("h,hv,dk,dv", [(16, 32, 128, 128), (2, 6, 64, 72)])
def test_verify_steps_equal_single_token_steps_bitwise(h: int, hv: int, dk: int, dv: int) -> None:
    """Verify rows over several steps (each replaying the previous step's accepted records) against
    the same tokens decoded one per call from the committed state: outputs, and committed states
    materialised by the kernel, bit for bit."""
    row = [3, 0, 5, 1]
    pool = torch.randn(8, hv, dv, dk, device="cuda")
    single = pool.clone()
    single[7] = pool[row[0]]  # the committed state, slot 7 of the single-token pool
    a = 1
    for step, (q_len, accept) in enumerate([(4, 3), (4, 1), (2, 2), (4, 4), (3, 2)]):
        x = inputs(q_len, h, hv, dk, dv, torch.bfloat16, seed=10 + step)
        out = run_update(cuda_ops.gated_delta_rule_update, x, pool, [q_len], [row], [a])
        states = []
        single[6] = single[7]
        for t in range(q_len):  # slot 6 carries the state from token to token
            one = {n: v[t:t + 1] for n, v in x.items()}
            assert torch.equal(run_update(cuda_ops.gated_delta_rule_update, one, single, [1], [[6, -1, -1, -1]], [1]),
                               out[t:t + 1]), f"step {step} token {t}"
            states.append(single[6].clone())
        for t in range(q_len):
            assert torch.equal(materialised(cuda_ops.gated_delta_rule_materialise, pool, row, t + 1), states[t])
        a = accept
        single[7] = states[a - 1]


@needs_kernels
def test_neighbours_do_not_matter() -> None:
    h, hv, dk, dv = 16, 32, 128, 128
    x = inputs(4, h, hv, dk, dv, torch.bfloat16, seed=1)
    base = torch.randn(12, hv, dv, dk, device="cuda")
    prev = inputs(4, h, hv, dk, dv, torch.bfloat16, seed=3)
    run_update(cuda_ops.gated_delta_rule_update, prev, base, [4], [[0, 1, 2, 3]], [1])  # records to replay
    together = base.clone()
    out = run_update(cuda_ops.gated_delta_rule_update, x, together, [4], [[0, 1, 2, 3]], [3])
    y = inputs(2, h, hv, dk, dv, torch.bfloat16, seed=2)
    mixed = {n: torch.cat([y[n][:1], x[n], y[n][1:]]) for n in x}
    crowd = base.clone()
    out2 = run_update(cuda_ops.gated_delta_rule_update, mixed, crowd, [1, 4, 1],
                      [[5, 6, 7, 8], [0, 1, 2, 3], [9, -1, -1, -1]], [2, 3, 1])
    assert torch.equal(out2[1:5], out) and torch.equal(crowd[:4], together[:4])


@needs_kernels
@pytest.mark.parametrize("slots", [5, 16])
def test_persistent_grid_equals_rows_alone(slots: int) -> None:
    """More items (row, value head, tile) than the device holds at once: the persistent grid, where a
    block prefetches its next item's base and keeps q / k across the items of one key head, against
    each row launched alone (one block per item, the base loaded directly), bit for bit: outputs and
    every slot of the row (base and records); and against the reference. Rows of 1..slots tokens
    (16: more than one shared-memory round of tokens and of records), every acceptance length, a PAD
    row in the middle."""
    h, hv, dk, dv = 16, 32, 128, 128
    rows = 24  # 3072 items: past 5 blocks on each of 132 multiprocessors
    lengths = [1 + (5 * n) % slots for n in range(rows)]
    idx = [[slots * n + j for j in range(slots)] for n in range(rows)]
    idx[7] = [-1] * slots
    acc = [1 + (7 * n) % slots for n in range(rows)]
    pool = torch.randn(slots * rows, hv, dv, dk, device="cuda") * 0.3
    prev = inputs(slots * rows, h, hv, dk, dv, torch.bfloat16, seed=7)
    run_update(cuda_ops.gated_delta_rule_update, prev, pool, [slots] * rows, idx, [1] * rows)  # records to replay
    x = inputs(sum(lengths), h, hv, dk, dv, torch.bfloat16, seed=8)
    together, ref_state = pool.clone(), pool.clone()
    out = run_update(cuda_ops.gated_delta_rule_update, x, together, lengths, idx, acc)
    ref = run_update(reference.gated_delta_rule_update, x, ref_state, lengths, idx, acc)
    torch.testing.assert_close(out.float(), ref.float(), atol=8e-2, rtol=2e-2)
    torch.testing.assert_close(together, ref_state, atol=1e-4, rtol=1e-4)
    start = 0
    for n in range(rows):
        alone = pool.clone()
        one = {name: t[start:start + lengths[n]] for name, t in x.items()}
        got = run_update(cuda_ops.gated_delta_rule_update, one, alone, [lengths[n]], [idx[n]], [acc[n]])
        assert torch.equal(got, out[start:start + lengths[n]]), f"row {n}"
        row_slots = [slots * n + j for j in range(slots)]
        assert torch.equal(alone[row_slots], together[row_slots]), f"row {n}"
        start += lengths[n]


@needs_kernels
@pytest.mark.parametrize("rows", [1, 5, 24])
def test_grids_agree_bitwise(rows: int, monkeypatch) -> None:
    """The same step under each grid the kernel has for K <= 128 (ops.cuda.gdn.force_grid): one block per
    item, every load of a staging round in flight at once, and the persistent grid, a token or record
    at a time with the next item's base prefetched. At 1 row the direct grid holds one value row per
    lane (8 warps a tile), at 5 and 24 two, as the persistent grid always does: the layouts agree too. Verify rows of 1..16 tokens (two rounds of tokens
    and of records), every acceptance length, a PAD row; prefill rows (final state only) and
    materialised states: outputs and every slot, bit for bit. The kernel picks the grid by the step's
    size, so this is what lets it: a row's arithmetic is the same under both."""
    h, hv, dk, dv, slots = 16, 32, 128, 128, 16
    lengths = [1 + (7 * n + 3) % slots for n in range(rows)]
    idx = [[slots * n + j for j in range(slots)] for n in range(rows)]
    if rows > 1:
        idx[rows // 2] = [-1] * slots
    acc = [1 + (5 * n + 2) % slots for n in range(rows)]
    pool = torch.randn(slots * rows + 1, hv, dv, dk, device="cuda") * 0.3
    prev = inputs(slots * rows, h, hv, dk, dv, torch.bfloat16, seed=11)
    run_update(cuda_ops.gated_delta_rule_update, prev, pool, [slots] * rows, idx, [1] * rows)  # records to replay
    x = inputs(sum(lengths), h, hv, dk, dv, torch.bfloat16, seed=12)
    init = torch.tensor([n % 3 != 1 for n in range(rows)], device="cuda")
    results = {}
    for grid in ("direct", "persistent"):
        monkeypatch.setattr(cuda_gdn, "force_grid", grid)
        verify, prefill, mat = pool.clone(), pool.clone(), pool.clone()
        out = run_update(cuda_ops.gated_delta_rule_update, x, verify, lengths, idx, acc)
        pout = cuda_ops.gated_delta_rule_chunked(x["q"], x["k"], x["v"], x["g"], x["beta"], qsl(lengths), prefill,
                                                 i32(idx), i32(acc), init)
        cuda_ops.gated_delta_rule_materialise(mat, i32(idx), i32(acc), i32([slots * rows] + [-1] * (rows - 1)))
        results[grid] = (out, verify, pout, prefill, mat)
    for got, want in zip(results["direct"], results["persistent"]):
        assert torch.equal(got, want)
    assert not torch.equal(results["direct"][1], pool)  # the step wrote its slots


@needs_kernels
def test_persistent_prefill_equals_rows_alone() -> None:
    """Prefill rows (final state only, some longer than a shared-memory round of tokens, some from
    base + records, some from zeros) on the persistent grid against each row alone, bit for bit."""
    h, hv, dk, dv = 16, 32, 128, 128
    rows = 24
    lengths = [1 + (11 * n) % 21 for n in range(rows)]
    idx = [[2 * n, 2 * n + 1] for n in range(rows)]
    acc, init = [1 + n % 2 for n in range(rows)], [n % 3 != 0 for n in range(rows)]
    pool = torch.randn(2 * rows, hv, dv, dk, device="cuda") * 0.3
    prev = inputs(2 * rows, h, hv, dk, dv, torch.bfloat16, seed=9)
    run_update(cuda_ops.gated_delta_rule_update, prev, pool, [2] * rows, idx, [1] * rows)  # a record per row
    x = inputs(sum(lengths), h, hv, dk, dv, torch.bfloat16, seed=10)

    def prefill(xs: dict, state: torch.Tensor, rows_: list[int]) -> torch.Tensor:
        return cuda_ops.gated_delta_rule_chunked(xs["q"], xs["k"], xs["v"], xs["g"], xs["beta"],
                                                 qsl([lengths[n] for n in rows_]), state, i32([idx[n] for n in rows_]),
                                                 i32([acc[n] for n in rows_]),
                                                 torch.tensor([init[n] for n in rows_], device="cuda"))

    together = pool.clone()
    out = prefill(x, together, list(range(rows)))
    start = 0
    for n in range(rows):
        alone = pool.clone()
        got = prefill({name: t[start:start + lengths[n]] for name, t in x.items()}, alone, [n])
        assert torch.equal(got, out[start:start + lengths[n]]), f"row {n}"
        assert torch.equal(alone[2 * n], together[2 * n]), f"row {n}"
        start += lengths[n]


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_prefill_matches_chunked_reference(dtype: torch.dtype) -> None:
    h, hv, dk, dv = 2, 4, 64, 32
    lengths, init = [70, 1, 130, 0], [True, False, True, False]
    idx, acc = [[0, 1], [2, 3], [4, 5], [6, 7]], [2, 1, 1, 1]
    x = inputs(sum(lengths), h, hv, dk, dv, dtype, seed=3)
    base = torch.randn(8, hv, dv, dk, device="cuda") * 0.3
    prev = inputs(2, h, hv, dk, dv, dtype, seed=4)
    run_update(reference.gated_delta_rule_update, prev, base, [2], [[0, 1]], [1])  # a record in slot 1 (row 0: a = 2)
    got_state, ref_state = base.clone(), base.clone()
    args = (qsl(lengths),)
    got = cuda_ops.gated_delta_rule_chunked(x["q"], x["k"], x["v"], x["g"], x["beta"], *args, got_state, i32(idx),
                                            i32(acc), torch.tensor(init, device="cuda"))
    ref = reference.gated_delta_rule_chunked(x["q"], x["k"], x["v"], x["g"], x["beta"], *args, ref_state, i32(idx),
                                             i32(acc), torch.tensor(init, device="cuda"))
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-4
    torch.testing.assert_close(got.float(), ref.float(), atol=tol * 4, rtol=tol)
    torch.testing.assert_close(got_state, ref_state, atol=2e-4, rtol=2e-4)
    assert torch.equal(got_state[[1, 3, 5, 7]], base[[1, 3, 5, 7]])  # only idx[n, 0] is written
    # from base + record == from the materialised state with a = 1, bit for bit
    flat = base.clone()
    cuda_ops.gated_delta_rule_materialise(flat, i32([[0, 1]]), i32([2]), i32([0]))
    again = cuda_ops.gated_delta_rule_chunked(x["q"], x["k"], x["v"], x["g"], x["beta"], *args, flat, i32(idx),
                                              i32([1, 1, 1, 1]), torch.tensor(init, device="cuda"))
    assert torch.equal(again, got) and torch.equal(flat[[0, 2, 4]], got_state[[0, 2, 4]])


@needs_kernels
def test_prefill_switch_runs_the_chunked_kernel() -> None:
    """ops.gated_delta_rule_prefill (the model's prefill call) on CUDA: with gdn_chunked_prefill the
    chunk-wise kernel, its outputs and final states exactly, within fp32 tolerance of the recurrence
    but not its bits (130 tokens: three chunks); by default, under batch_invariant or with the switch
    off, the recurrence, bit for bit."""
    from pyengine import ops
    from pyengine.ops.cuda import gdn_prefill
    from pyengine.ops.kernel_config import use_kernel_config

    h, hv, dk, dv = 2, 4, 64, 32
    lengths, init = [70, 1, 130], torch.tensor([True, False, True], device="cuda")
    idx, acc = i32([[0, 1], [2, 3], [4, 5]]), i32([1, 1, 1])
    x = inputs(sum(lengths), h, hv, dk, dv, torch.float32, seed=5)
    base = torch.randn(6, hv, dv, dk, device="cuda") * 0.3
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], qsl(lengths))

    def prefill(fn, **config) -> tuple[torch.Tensor, torch.Tensor]:
        state = base.clone()
        with use_kernel_config(**config):
            return fn(*args, state, idx, acc, init), state

    default, recurrence = (prefill(ops.gated_delta_rule_prefill, gdn_chunked_prefill=True),
                           prefill(ops.gated_delta_rule_chunked))
    kernel_state = base.clone()
    kernel = gdn_prefill.chunked_gated_delta_rule_prefill(*args[:5], kernel_state, qsl(lengths), idx, init)
    assert torch.equal(default[0], kernel) and torch.equal(default[1], kernel_state)
    for got, want in zip(default, recurrence):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert not (torch.equal(default[0], recurrence[0]) and torch.equal(default[1], recurrence[1]))
    for config in (dict(), dict(batch_invariant=True, gdn_chunked_prefill=True), dict(gdn_chunked_prefill=False)):
        out, state = prefill(ops.gated_delta_rule_prefill, **config)
        assert torch.equal(out, recurrence[0]) and torch.equal(state, recurrence[1]), config


def test_qwen3_next_chunked_prefill_greedy_equals_recurrence(tmp_path, monkeypatch) -> None:
    """A tiny fp32 Qwen3-Next, prompts of 65..140 tokens (past a 64-token chunk): with the switch on every
    prefill runs the chunk-wise kernel under gdn_chunked_prefill, and the first tokens' logits differ
    from the recurrence's (the default) in the last bits only; greedy tokens are the same."""
    import random

    from pyengine.ops.cuda import gdn_prefill
    from tests.tiny_models import VOCAB, make_qwen3_next_checkpoint

    path = str(tmp_path / "q3n")
    make_qwen3_next_checkpoint(path, layer_scale=0.3, linear_key_head_dim=32, linear_value_head_dim=32, head_dim=64)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (65, 80, 97, 110, 128, 140)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    calls = []
    launch = gdn_prefill.chunked_gated_delta_rule_prefill
    monkeypatch.setattr(gdn_prefill, "chunked_gated_delta_rule_prefill",
                        lambda *a, **kw: calls.append(a[0].shape[0]) or launch(*a, **kw))

    def generate(chunked: bool) -> list[tuple[list[int], torch.Tensor]]:
        llm = LLM(path, device="cuda", dtype="float32", max_model_len=256,
                  kernel_config={"gdn_chunked_prefill": chunked})
        llm.engine.cfg.record_logits = True
        reqs = llm.run_requests([(None, p) for p in prompts], [params] * len(prompts))
        out = [(list(r.output_token_ids), r.logits[0].cpu()) for r in reqs]
        del llm
        gc.collect()
        return out

    chunked = generate(True)
    assert sum(calls) >= sum(len(p) for p in prompts)  # every prompt token went through the kernel
    calls.clear()
    recurrence = generate(False)
    assert not calls
    assert [t for t, _ in chunked] == [t for t, _ in recurrence]
    for (_, a), (_, b) in zip(chunked, recurrence):
        torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-3)
    assert any(not torch.equal(a, b) for (_, a), (_, b) in zip(chunked, recurrence))


def test_qwen3_next_mtp_end_to_end(tmp_path) -> None:
    """A tiny Qwen3-Next in bf16 on the GPU (GDN and conv kernels, paged attention) with MTP k = 3:
    drafts accepted, greedy output equal to plain decoding for (nearly) every request."""
    from tests.tiny_models import make_prompts, make_qwen3_next_checkpoint

    path = str(tmp_path / "q3n")
    make_qwen3_next_checkpoint(path, mtp_agreement=0.01, layer_scale=0.01, linear_key_head_dim=32,
                               linear_value_head_dim=32, head_dim=64, num_attention_heads=2, num_key_value_heads=1)
    prompts = make_prompts(8, seed=2)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    def generate(**kw) -> tuple[list[list[int]], LLM]:
        llm = LLM(path, device="cuda", dtype="bfloat16", max_num_batched_tokens=64, **kw)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)], llm

    plain, graphed = generate()
    eager, _ = generate(enforce_eager=True)
    # decode steps replay CUDA graphs (the MoE's grouped path reads nothing on the host) with the
    # eager steps' tokens
    assert graphed.engine.runner.graph_runner.num_replays > 0 and plain == eager
    spec = {"method": "mtp", "num_speculative_tokens": 3, "adaptive_draft_length": False}
    outs, llm = generate(speculative_config=spec)
    assert llm.stats()["acceptance_rate"] > 0.3, llm.stats()
    assert llm.engine.runner.graph_runner.num_replays > 0  # verify steps replayed too; MTP reads their hidden states
    assert sum(a == b for a, b in zip(outs, plain)) >= 7
    del llm, graphed
    gc.collect()
