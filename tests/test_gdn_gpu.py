"""The CUDA Gated DeltaNet kernel (hipkernels/ssm/gated_delta_rule.hip) against the PyTorch
reference (pyengine/ops/reference/gdn.py): outputs and every token's state for every acceptance
length, PAD rows, grouped heads, fp32 and bf16; a verify row's tokens equal the same tokens
decoded one by one, bit for bit, and a row's bits do not depend on its neighbours; prefill rows
(final state only) against the chunked form. Qwen3-Next end to end with MTP. Skips without CUDA."""
from __future__ import annotations

import gc

import pytest
import torch

from pyengine import LLM, SamplingParams
from pyengine.ops import reference

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


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("h,hv,dk,dv", [(2, 4, 16, 24), (16, 32, 128, 128), (1, 2, 256, 64)])
def test_update_matches_reference(dtype: torch.dtype, h: int, hv: int, dk: int, dv: int) -> None:
    k_spec = 3
    lengths, acc = [1, 4, 2, 3, 1], [1, 4, 2, 3, 2]
    idx = [[0, 1, 2, 3], [4, 5, 6, 7], [-1, -1, -1, -1], [8, 9, 10, 11], [12, -1, 13, 14]]
    x = inputs(sum(lengths), h, hv, dk, dv, dtype)
    base = torch.randn(16, hv, dv, dk, device="cuda")
    got_state, ref_state = base.clone(), base.clone()
    got = run_update(cuda_ops.gated_delta_rule_update, x, got_state, lengths, idx, acc)
    ref = run_update(reference.gated_delta_rule_update, x, ref_state, lengths, idx, acc)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(got.float(), ref.float(), atol=tol * 4, rtol=tol)
    torch.testing.assert_close(got_state, ref_state, atol=1e-4, rtol=1e-4)
    assert (got[5:7] == 0).all()  # the PAD row
    assert len(idx[0]) == 1 + k_spec


@needs_kernels
def test_verify_row_equals_single_steps_and_neighbours_do_not_matter() -> None:
    h, hv, dk, dv = 16, 32, 128, 128
    x = inputs(4, h, hv, dk, dv, torch.bfloat16, seed=1)
    base = torch.randn(8, hv, dv, dk, device="cuda")
    together = base.clone()
    out = run_update(cuda_ops.gated_delta_rule_update, x, together, [4], [[0, 1, 2, 3]], [1])
    single = base.clone()
    for t in range(4):  # token t starts from slot t - 1 (a = 2 reads idx[1]) and writes slot t
        one = {n: v[t:t + 1] for n, v in x.items()}
        step = run_update(cuda_ops.gated_delta_rule_update, one, single, [1], [[t, max(t - 1, 0), 7, 7]],
                          [1 if t == 0 else 2])
        assert torch.equal(step, out[t:t + 1])
    assert torch.equal(single[:4], together[:4])
    # the same row next to others: the same bits
    y = inputs(2, h, hv, dk, dv, torch.bfloat16, seed=2)
    mixed = {n: torch.cat([y[n][:1], x[n], y[n][1:]]) for n in x}
    crowd = base.clone()
    out2 = run_update(cuda_ops.gated_delta_rule_update, mixed, crowd, [1, 4, 1], [[5, 7, 7, 7], [0, 1, 2, 3],
                                                                                 [6, -1, -1, -1]], [1, 1, 1])
    assert torch.equal(out2[1:5], out) and torch.equal(crowd[:4], together[:4])


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_prefill_matches_chunked_reference(dtype: torch.dtype) -> None:
    h, hv, dk, dv = 2, 4, 64, 32
    lengths, init = [70, 1, 130, 0], [True, False, True, False]
    idx, acc = [[0, 1], [2, 3], [4, 5], [6, 7]], [2, 1, 1, 1]
    x = inputs(sum(lengths), h, hv, dk, dv, dtype, seed=3)
    base = torch.randn(8, hv, dv, dk, device="cuda") * 0.3
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
