"""The chunk-wise Gated DeltaNet prefill kernel (hipkernels/ssm/gdn_chunked_prefill.hip, wrapper
pyengine/ops/cuda/gdn_prefill.py) against the per-token recurrence (the reference decode step, one
token at a time: tests/test_gdn_chunked_emulation.per_token_prefill): outputs and final states for
lengths 1..300 across chunk boundaries, initial state on and off, PAD and empty rows, grouped heads,
fp32 and bf16; a row gives the same bits alone as next to other rows, and with strided inputs.
Skips without CUDA."""
from __future__ import annotations

import pytest
import torch

from tests.test_gdn_chunked_emulation import PAD, per_token_prefill

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

try:
    from pyengine.ops.cuda import gdn_prefill
except ImportError:
    gdn_prefill = None

needs_kernels = pytest.mark.skipif(gdn_prefill is None, reason="built without GPU kernels")

# fp32: the chunked form reassociates the recurrence's sums (Gram products, a triangular solve, one
# state update per chunk); on unit-norm keys and O(1) values that moves results by ~1e-6 relative,
# so 1e-4 (the emulation's tolerance) leaves room without hiding a wrong decay or a missed token.
FP32_TOL = dict(atol=1e-4, rtol=1e-4)
# bf16 inputs: both sides read the same bf16 q / k / v and compute in fp32; the outputs are rounded
# to bf16 once, so an fp32 difference of 1e-6 can still flip one bf16 rounding: one ulp is 2^-8
# relative (0.4 %). The states stay fp32 and keep the fp32 tolerance (inputs are identical).
BF16_OUT_TOL = dict(atol=1e-2, rtol=1e-2)


def inputs(lengths: list[int], h: int, hv: int, dk: int, dv: int, dtype: torch.dtype, seed: int = 0) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    ntok = sum(lengths)
    rnd = lambda *s: torch.randn(*s, generator=gen, device="cuda")  # noqa: E731
    return {"q": rnd(ntok, h, dk).to(dtype), "k": rnd(ntok, h, dk).to(dtype), "v": rnd(ntok, hv, dv).to(dtype),
            "g": -torch.nn.functional.softplus(rnd(ntok, hv)) * 0.5, "beta": torch.sigmoid(rnd(ntok, hv)),
            "query_start_loc": torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32)}


def run(fn, x: dict, state: torch.Tensor, idx: list[int], init: list[bool]) -> torch.Tensor:
    return fn(x["q"], x["k"], x["v"], x["g"], x["beta"], state, x["query_start_loc"],
              torch.tensor(idx, dtype=torch.int32, device="cuda")[:, None], torch.tensor(init, device="cuda"),
              x["q"].shape[-1] ** -0.5, True)


def pool(slots: int, hv: int, dv: int, dk: int, seed: int = 9) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(slots, hv, dv, dk, generator=gen, device="cuda") * 0.3


def kernel(*args) -> torch.Tensor:
    return gdn_prefill.chunked_gated_delta_rule_prefill(*args)


SHAPES = [(2, 4, 16, 24), (16, 32, 128, 128), (1, 2, 64, 40)]  # (H, HV, K, V): grouped, Qwen3-Next, odd tiles


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("h,hv,dk,dv", SHAPES)
def test_matches_recurrence(dtype: torch.dtype, h: int, hv: int, dk: int, dv: int) -> None:
    """Rows of lengths around each chunk boundary (and the hipcc build's 32), a PAD row, an empty
    row, with and without an initial state, in one launch."""
    lengths = [1, 31, 63, 64, 65, 5, 0, 128, 129, 300]
    idx = [0, 1, 2, 3, 4, PAD, 6, 7, 8, 9]
    init = [True, False, True, False, True, True, True, False, True, True]
    x = inputs(lengths, h, hv, dk, dv, dtype)
    base = pool(11, hv, dv, dk)
    got_state, ref_state = base.clone(), base.clone()
    got = run(kernel, x, got_state, idx, init)
    ref = run(per_token_prefill, x, ref_state, idx, init)
    torch.testing.assert_close(got.float(), ref.float(), **(FP32_TOL if dtype == torch.float32 else BF16_OUT_TOL))
    torch.testing.assert_close(got_state, ref_state, **FP32_TOL)
    pad = slice(sum(lengths[:5]), sum(lengths[:6]))
    assert (got[pad] == 0).all()
    for untouched in (5, 6, 10):  # PAD row's slot number, the empty row's slot, an unused slot
        assert torch.equal(got_state[untouched], base[untouched])


@needs_kernels
@pytest.mark.parametrize("length", list(range(1, 70)) + [95, 96, 97, 191, 192, 193, 255, 256, 257])
def test_every_length_qwen_widths(length: int) -> None:
    """Every length up to 69 and the boundaries after, at Qwen3-Next's widths, fp32."""
    x = inputs([length], 16, 32, 128, 128, torch.float32, seed=length)
    base = pool(1, 32, 128, 128, seed=length)
    got_state, ref_state = base.clone(), base.clone()
    got = run(kernel, x, got_state, [0], [True])
    ref = run(per_token_prefill, x, ref_state, [0], [True])
    torch.testing.assert_close(got, ref, **FP32_TOL)
    torch.testing.assert_close(got_state, ref_state, **FP32_TOL)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_bits_do_not_depend_on_the_batch(dtype: torch.dtype) -> None:
    """Each row alone gives bit for bit what it gives among other rows of other lengths."""
    lengths, idx, init = [200, 7, 64, 130], [3, 0, 2, 1], [True, False, True, True]
    h, hv, dk, dv = 16, 32, 128, 128
    x = inputs(lengths, h, hv, dk, dv, dtype, seed=5)
    base = pool(4, hv, dv, dk, seed=5)
    together = base.clone()
    out = run(kernel, x, together, idx, init)
    starts = x["query_start_loc"].tolist()
    for n, length in enumerate(lengths):
        rows = slice(starts[n], starts[n] + length)
        one = {name: t[rows] for name, t in x.items() if name != "query_start_loc"}
        one["query_start_loc"] = torch.tensor([0, length], dtype=torch.int32, device="cuda")
        alone = base.clone()
        got = run(kernel, one, alone, [idx[n]], [init[n]])
        assert torch.equal(got, out[rows]), f"row {n}"
        assert torch.equal(alone[idx[n]], together[idx[n]]), f"row {n} state"


@needs_kernels
def test_strided_inputs_and_null_initial_flags() -> None:
    """q, k, v as views of one fused projection (token stride > width) give the same bits as
    contiguous copies; has_initial_state None means every row has one."""
    h, hv, dk, dv, lengths = 4, 8, 128, 64, [70, 33]
    ntok = sum(lengths)
    fused = torch.randn(ntok, 2 * h * dk + hv * dv, device="cuda", dtype=torch.bfloat16)
    q = fused[:, :h * dk].view(ntok, h, dk)
    k = fused[:, h * dk:2 * h * dk].view(ntok, h, dk)
    v = fused[:, 2 * h * dk:].view(ntok, hv, dv)
    x = inputs(lengths, h, hv, dk, dv, torch.bfloat16, seed=3)
    qsl, idx = x["query_start_loc"], torch.tensor([[1], [0]], dtype=torch.int32, device="cuda")
    base = pool(2, hv, dv, dk)
    a, b = base.clone(), base.clone()
    strided = gdn_prefill.chunked_gated_delta_rule_prefill(q, k, v, x["g"], x["beta"], a, qsl, idx, None)
    dense = gdn_prefill.chunked_gated_delta_rule_prefill(q.contiguous(), k.contiguous(), v.contiguous(), x["g"],
                                                         x["beta"], b, qsl, idx, torch.tensor([True, True],
                                                                                              device="cuda"))
    assert torch.equal(strided, dense) and torch.equal(a, b)
    assert not torch.equal(a, base)


@needs_kernels
def test_a_wrong_initial_state_is_seen() -> None:
    """The comparison can fail: the same row from zeros instead of its slot differs."""
    x = inputs([100], 2, 4, 16, 24, torch.float32, seed=8)
    base = pool(1, 4, 24, 16)
    with_init = run(kernel, x, base.clone(), [0], [True])
    without = run(kernel, x, base.clone(), [0], [False])
    assert not torch.allclose(with_init, without, atol=1e-3)
