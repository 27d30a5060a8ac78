"""The integer-dot GEMMs of GGUF-coded weights (csrc/cpu/cpu_gemm_qdot.h: int8 activations, act_bits
8, and two int16 limbs, act_bits 32) against their pure-PyTorch spec (pyengine/ops/reference/
quant_dot.py): the same bits for every M, row group, thread count and pool policy, the quantisers'
edge cases included; and their error against the exact products of the dequantised weights within
what the activations' rounding allows (int16x2: that of fp32 products)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pyengine.loader.gguf_dequant import Q4_0, Q4_1, Q8_0, decode, dequantize
from pyengine.ops.reference.quant_dot import gguf_weight_codes, quant_linear, quantise_activations
from tests.test_gguf_codes import LAYOUTS, addresses, random_blocks

cpu_ops = pytest.importorskip("pyengine.ops.cpu")
PackedLinear = cpu_ops.PackedLinear
kernels = cpu_ops.kernels
TYPES = [Q4_0, Q4_1, Q8_0]
ACT_BITS = [8, 32]  # int8 activations (KernelConfig.cpu_int8_dot), two int16 limbs (cpu_int16_dot)


def _weight(ggml_type: int, rows: int, cols: int, seed: int = 0, act_bits: int = 8):
    """A PackedLinear from random GGUF blocks (rows taken in a shuffled order, as q/k and fused
    linears are) and the reference's (scale, offset, codes) of the same matrix."""
    raw = random_blocks(ggml_type, rows, cols, seed)
    order = np.random.default_rng(seed + 1).permutation(rows)
    packed = PackedLinear.from_gguf(ggml_type, addresses(raw, order), cols, int8_dot=act_bits == 8,
                                    int16_dot=act_bits == 32)
    if packed is None or not (packed.int8_dot if act_bits == 8 else packed.int16_dot):
        pytest.skip("no integer-dot GEMM on this CPU (AVX2 + F16C)")
    codes = gguf_weight_codes(decode(raw.reshape(-1), ggml_type, rows, cols).map_rows(lambda a: a[order]))
    dense = torch.from_numpy(dequantize(raw.reshape(-1), ggml_type, (rows, cols))[order].T.copy())  # [in, out]
    return packed, codes, dense


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit where not NaN, NaN at the same places (a NaN's sign depends on the operand order)."""
    nan = torch.isnan(a)
    return torch.equal(nan, torch.isnan(b)) and torch.equal(a[~nan].view(torch.int32), b[~nan].view(torch.int32))


@pytest.mark.parametrize("act_bits", ACT_BITS)
@pytest.mark.parametrize("ggml_type", TYPES)
@pytest.mark.parametrize("rows,cols", [(40, 96), (200, 1536)])  # a partial last panel; SmolLM2's down K
def test_every_m_equals_the_reference(ggml_type: int, rows: int, cols: int, act_bits: int) -> None:
    packed, (scale, offset, codes), _ = _weight(ggml_type, rows, cols, act_bits=act_bits)
    gen = torch.Generator().manual_seed(ggml_type)
    wide = torch.randn(300, cols + 24, generator=gen) * 3.0
    x = wide[:, 7:7 + cols]  # strided rows
    bias = torch.randn(rows, generator=gen)
    want = quant_linear(x, scale, offset, codes, act_bits=act_bits)
    want_bias = quant_linear(x, scale, offset, codes, bias, act_bits=act_bits)
    for m in (1, 2, 3, 4, 5, 7, 17, 64, 300):
        assert _same(packed(x[:m]), want[:m]), f"M {m}"
        assert _same(packed(x[:m], bias), want_bias[:m]), f"M {m}, bias"
    assert _same(packed(x[150:151]), want[150:151])  # a row alone == in a batch


@pytest.mark.parametrize("act_bits", ACT_BITS)
@pytest.mark.parametrize("ggml_type", [Q4_1, Q8_0])
def test_bits_do_not_depend_on_threads_or_the_stall_policy(ggml_type: int, act_bits: int, restore_pool) -> None:
    packed, (scale, offset, codes), _ = _weight(ggml_type, 200, 576, seed=4, act_bits=act_bits)
    x = torch.randn(130, 576, generator=torch.Generator().manual_seed(2))  # 130 x 576: quantised by the pool
    want = quant_linear(x, scale, offset, codes, act_bits=act_bits)
    torch.set_num_threads(1)
    for threads in (1, 2, 3):
        for adaptive, fraction in ((False, 0.5), (True, 0.0), (True, 1.0)):
            kernels.set_num_threads(threads)
            kernels.set_pool_adaptive(adaptive)
            kernels.set_pool_absent_fraction(fraction)
            for m in (1, 2, 33, 130):
                assert _same(packed(x[:m]), want[:m]), f"{threads} threads, {adaptive} {fraction}, M {m}"


@pytest.mark.parametrize("isa", ["avx512", "amx"])
@pytest.mark.parametrize("ggml_type", TYPES)
def test_int16_limbs_give_the_same_bits_on_every_isa(ggml_type: int, isa: str) -> None:
    """The int16-limb kernels on AVX-512 VNNI (cpu_gemm_qdot16_avx512.cpp) and on AMX tiles
    (cpu_gemm_qdot16_amx.cpp: groups of 8 rows, a last group padded) against the AVX2 ones on the
    same panels: bit for bit at every row-group size, with a bias, a partial last panel and
    non-finite rows (all also equal the spec: test_every_m_equals_the_reference)."""
    raw = random_blocks(ggml_type, 40, 1536, seed=9)
    rows = addresses(raw, np.arange(40))
    fast = PackedLinear.from_gguf(ggml_type, rows, 1536, int8_dot=False, int16_dot=True, isa=isa)
    avx2 = PackedLinear.from_gguf(ggml_type, rows, 1536, int8_dot=False, int16_dot=True, isa="avx2")
    if fast is None or fast.isa != isa:
        pytest.skip(f"no {isa} kernels on this CPU")
    assert avx2.isa == "avx2"
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(70, 1536, generator=gen) * torch.logspace(-4, 3, 1536)
    x[5, 100] = float("nan")
    x[6, 1500] = float("inf")
    x[9, :32] = 0.0  # a zero block
    bias = torch.randn(40, generator=gen)
    for m in (1, 2, 3, 4, 5, 6, 7, 8, 9, 15, 16, 17, 70):
        assert _same(fast(x[:m]), avx2(x[:m])), f"M {m}"
        assert _same(fast(x[:m], bias), avx2(x[:m], bias)), f"M {m}, bias"
    assert _same(fast(x[3:12]), avx2(x[3:12]))


def test_quantiser_edge_cases() -> None:
    """Ties round to even; a block under 2^-100 is zero, one at 2^-100 is not; inf or NaN in a
    block makes its row NaN; the kernel agrees on all of it."""
    x = torch.zeros(6, 64)
    x[1, :32] = 2.0 ** -101  # tiny block: zeros
    x[1, 32:] = 2.0 ** -100
    x[2, :4] = torch.tensor([127.0, 2.5, -3.5, 0.5])  # amax 127: x * 1 -> ties at .5
    x[3, 40] = float("inf")
    x[4, 3] = float("nan")
    x[5] = torch.linspace(-3e38, 3e38, 64)
    q, d, sx = quantise_activations(x)
    assert q[2, :4].tolist() == [127, 2, -4, 0] and d[2, 0] == torch.tensor(127.0) / torch.tensor(127.0)
    assert d[1].tolist() == [0.0, (torch.tensor(2.0 ** -100) / torch.tensor(127.0)).item()] and q[1, :32].eq(0).all()
    assert q[1, 32:].eq(127).all() and sx[1, 1] == d[1, 1] * 127 * 32
    assert torch.isnan(d[3, 1]) and not torch.isnan(d[3, 0]) and torch.isnan(d[4, 0]) and q[3, 32:].eq(0).all()
    assert d[0].eq(0).all() and q[0].eq(0).all()
    for act_bits in ACT_BITS:
        for ggml_type in TYPES:
            packed, (scale, offset, codes), _ = _weight(ggml_type, 40, 64, seed=5, act_bits=act_bits)
            want = quant_linear(x, scale, offset, codes, act_bits=act_bits)
            got = packed(x)
            assert torch.isnan(want[3]).all() and torch.isnan(want[4]).all() and not torch.isnan(want[:3]).any()
            assert _same(got, want)


def test_int16_limbs_edge_cases() -> None:
    """Two int16 limbs (act_bits 32): the first limb rounds half to even, the second holds the
    remainder to 2^-15 (+-16384 at a tie); the limbs give every input to fp32's precision (the
    scaling's roundings, ~2^-22 of it) plus 2^-31 of its block's largest magnitude; tiny and
    non-finite blocks as for int8."""
    x = torch.zeros(5, 64)
    x[0, :3] = torch.tensor([32767.0, 2.5, -3.5])  # amax 32767: p = x, ties
    x[1, :32] = 2.0 ** -101
    x[1, 32:] = torch.linspace(-1.0, 1.0, 32) * 2.0 ** -100
    x[2] = torch.randn(64, generator=torch.Generator().manual_seed(3)) * torch.logspace(-6, 6, 64)
    x[3, 5] = float("nan")
    x[4, 40] = float("-inf")
    q, d, sx = quantise_activations(x, act_bits=32)
    assert q.shape == (2, 5, 64) and q.dtype == torch.int16
    assert q[0, 0, :3].tolist() == [32767, 2, -4] and q[1, 0, :3].tolist() == [0, 16384, 16384]
    assert q[:, 1, :32].eq(0).all() and d[1, 0] == 0 and d[1, 1] > 0 and q[0, 1, 32:].abs().max() == 32767
    assert torch.isnan(d[3, 0]) and not torch.isnan(d[3, 1]) and torch.isnan(d[4, 1]) and q[:, 4, 32:].eq(0).all()
    held = d.repeat_interleave(32, -1).double() * (q[0].double() + q[1].double() / 2 ** 15)
    amax = x.abs().view(5, 2, 32).amax(-1).repeat_interleave(32, -1).double()
    ok = ~torch.isnan(held) & (d.repeat_interleave(32, -1) > 0)  # tiny blocks are zero (above)
    assert ((held - x.double()).abs()[ok] <= (x.double().abs() * 2.0 ** -21 + amax * 2.0 ** -30)[ok]).all()
    assert torch.equal(sx[:3], d[:3] * (q[0, :3].view(3, 2, 32).float().sum(-1) + q[1, :3].view(3, 2, 32).float().sum(-1) / 2 ** 15))


@pytest.mark.parametrize("ggml_type", TYPES)
def test_error_is_within_the_quantisation_bound(ggml_type: int) -> None:
    """|y - x @ W| <= sum over blocks of (d_b / 2) * sum_k |w_kc|, plus fp32 rounding: what
    rounding each x_k to the nearest multiple of d_b can cost, and no more."""
    packed, _, dense = _weight(ggml_type, 64, 576, seed=6)
    x = torch.randn(9, 576, generator=torch.Generator().manual_seed(6)) * torch.logspace(-3, 2, 576)
    _, d, _ = quantise_activations(x)
    exact = x.double() @ dense.double()
    bound = torch.einsum("mb,bn->mn", d.double() / 2, dense.double().abs().view(18, 32, -1).sum(1))
    rounding = 1e-5 * (x.double().abs() @ dense.double().abs())
    err = (packed(x).double() - exact).abs()
    assert (err <= bound * 1.001 + rounding).all()
    assert (err > 0).any()  # not the exact products (which the bound would also allow)


@pytest.mark.parametrize("ggml_type", TYPES)
def test_int16_limbs_are_as_close_as_fp32_products(ggml_type: int) -> None:
    """Two int16 limbs: |y - x @ W| (x @ W in float64) stays within 2^-20 of sum |x| |w|, as the
    fp32 products of the dequantised weights do (one int16 limb is ~2^-16 off, int8 ~2^-8), and
    its largest error is within 2x of theirs."""
    packed, _, dense = _weight(ggml_type, 64, 576, seed=6, act_bits=32)
    x = torch.randn(9, 576, generator=torch.Generator().manual_seed(6)) * torch.logspace(-3, 2, 576)
    exact = x.double() @ dense.double()
    scale = x.double().abs() @ dense.double().abs()
    err = (packed(x).double() - exact).abs()
    fp32 = ((x @ dense).double() - exact).abs()
    assert (err <= scale * 2.0 ** -20).all()
    assert err.max() <= 2 * fp32.max()


def test_a_q4_0_offset_beyond_fp16_keeps_the_exact_products() -> None:
    """Q4_0's offset -8 d must be an fp16 value for the int8-dot panels; where it is not
    (|d| > 8188) the weight is packed as before: the dequantised weights' fp32 products."""
    raw = random_blocks(Q4_0, 16, 64, seed=7)
    raw.view(np.dtype(LAYOUTS[Q4_0]))["d"][2, 1] = 10000.0
    packed = PackedLinear.from_gguf(Q4_0, addresses(raw, np.arange(16)), 64, int8_dot=True)
    if packed is None:
        pytest.skip("no packed GEMM here")
    assert not packed.int8_dot and packed.bits_per_weight == 4
    dense = torch.from_numpy(dequantize(raw.reshape(-1), Q4_0, (16, 64)).T.copy())
    x = torch.randn(5, 64)
    assert torch.equal(packed(x), PackedLinear(dense)(x))


@pytest.mark.parametrize("act_bits", ACT_BITS)
def test_layer_stack_equals_the_layer_loop(smollm2_path: str, act_bits: int) -> None:
    """The default model from its codes: the C++ layer stack and the op-by-op loop give the same
    hidden states over a mixed step, decode and verify-shaped steps (the integer-dot GEMM in both)."""
    from pyengine.loader import load_model
    from pyengine.ops.kernel_config import use_kernel_config
    from tests.utils_paged import PagedCache, make_meta

    from pyengine.ops.kernel_config import KernelConfig

    with use_kernel_config(KernelConfig(cpu_int8_dot=act_bits == 8, cpu_int16_dot=act_bits == 32)):
        model, config, _ = load_model(smollm2_path, "cpu", torch.float32)
    if not getattr(model.layers[0].qkv_proj, "int8_dot" if act_bits == 8 else "int16_dot", False) or model.cpu_stack is None:
        pytest.skip("no integer-dot GEMM or layer stack on this CPU")
    outs: dict[str, list[torch.Tensor]] = {}
    for mode in ("stack", "loop"):
        cache = PagedCache(config, 24, 16, torch.float32, seed=1)
        tables: list[list[int]] = [[], [], []]
        for t, n in zip(tables, (40, 9, 130)):
            cache.grow(t, n + 8)
        gen = torch.Generator().manual_seed(0)
        steps = [[(tables[0], 0, 40), (tables[1], 0, 9), (tables[2], 0, 3)],
                 [(tables[0], 40, 1), (tables[1], 9, 4), (tables[2], 3, 127)],
                 [(tables[0], 41, 1), (tables[1], 13, 1), (tables[2], 130, 2)]]
        outs[mode] = []
        with use_kernel_config(cpu_layer_stack=mode == "stack"), torch.inference_mode():
            for rows in steps:
                tokens = torch.randint(0, config.vocab_size, (sum(q for _, _, q in rows),), generator=gen)
                meta, positions = make_meta(rows, cache.block_size)
                outs[mode].append(model(tokens, positions, meta, cache.kv_caches))
    for a, b in zip(outs["stack"], outs["loop"]):
        assert torch.equal(a, b)
