"""Per-token layer kernels (hipkernels/layer_ops/ via pyengine.ops.cuda) against the PyTorch
references of pyengine/ops/reference/layer.py.

Tolerances, and why they are this tight. Kernel and reference both compute in fp32 and round once
on store. RoPE (three separately rounded fp32 operations in both), the residual add and the KV
copies are the same arithmetic in the same order: they must be bit-identical. The norms sum the
squares in a different order (a block reduction against torch's), so their fp32 scale can differ by
a few fp32 ulps; silu's exp may differ in its last fp32 bit. After the one rounding to bf16/fp16 that
moves a result by at most one ulp of the output dtype, and only when the fp32 value lies within a
few fp32 ulps of a rounding boundary: we allow 1 ulp per element and require all but a sliver
(< 1%) of the elements to be bit-identical.

Also: 16-byte and one-element access paths (odd widths), strided rows as llama.py produces them
(q|k and v are views into the qkv GEMM output), slot -1 writes nothing and unused cache pages
(NaN) stay untouched, and batch invariance (a token alone and in a batch: the same bits).
"""
from __future__ import annotations

import pytest
import torch

from pyengine import ops
from pyengine.ops import reference as ref

try:
    from pyengine.ops import cuda as cuda_ops
except ImportError:  # no GPU kernels in this build
    cuda_ops = None

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or cuda_ops is None or not hasattr(cuda_ops, "rope_and_cache"),
                       reason="needs CUDA and the GPU layer kernels"),
]

DEV = "cuda"
HALF_TYPES = [torch.bfloat16, torch.float16]
EPS = 1e-5


def rand(*shape: int, dtype: torch.dtype, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen, device=DEV) * scale).to(dtype)


def bits(x: torch.Tensor) -> torch.Tensor:
    """The storage bits as integers (NaN == NaN, -0 != +0)."""
    return x.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()])


def assert_bits_equal(out: torch.Tensor, expected: torch.Tensor) -> None:
    assert out.shape == expected.shape and out.dtype == expected.dtype
    diff = (bits(out) != bits(expected)).sum().item()
    assert diff == 0, f"{diff} of {out.numel()} elements differ"


def assert_within_one_ulp(out: torch.Tensor, expected: torch.Tensor, max_off_fraction: float = 0.01) -> None:
    """Every element within one ulp of the output dtype (neighbouring bit patterns of the same sign),
    and at most max_off_fraction of them not bit-identical."""
    assert out.shape == expected.shape and out.dtype == expected.dtype
    assert not torch.isnan(out).any(), "NaN in the kernel output"
    a, b = bits(out).long(), bits(expected).long()
    same_sign = (out.float() >= 0) == (expected.float() >= 0)
    off = a != b
    worst = (a - b).abs().max().item()
    assert bool((~off | (same_sign & ((a - b).abs() <= 1))).all()), f"an element is off by more than 1 ulp ({worst})"
    assert off.float().mean().item() <= max_off_fraction, f"{off.sum().item()} of {out.numel()} elements off by 1 ulp"


def assert_norm_close(out: torch.Tensor, expected: torch.Tensor) -> None:
    """fp32: close (the squares are summed in another order); half types: within one ulp."""
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    else:
        assert_within_one_ulp(out, expected)


def test_dispatch_uses_the_kernels():
    for name in ("rms_norm", "fused_add_rms_norm", "silu_and_mul", "rope_and_cache"):
        assert ops._impl(torch.device(DEV), name) is getattr(cuda_ops, name)


# ---- rms_norm / fused_add_rms_norm ----------------------------------------------------------------

# 576 / 4096: SmolLM2 / Llama-3-8B; 1001: one element per access; 24584: wider than one block keeps
# in registers (the re-read path); 8: narrower than a warp.
NORM_WIDTHS = [576, 4096, 1001, 24584, 8]


@pytest.mark.parametrize("dtype", HALF_TYPES + [torch.float32])
@pytest.mark.parametrize("hidden", NORM_WIDTHS)
def test_rms_norm_matches_reference(dtype, hidden):
    gen = torch.Generator(device=DEV).manual_seed(hidden)
    for t in (1, 7, 33):
        x = rand(t, hidden, dtype=dtype, gen=gen, scale=3.0)
        w = rand(hidden, dtype=dtype, gen=gen)
        assert_norm_close(cuda_ops.rms_norm(x, w, EPS), ref.rms_norm(x, w, EPS))


@pytest.mark.parametrize("dtype", HALF_TYPES)
def test_rms_norm_strided_rows(dtype):
    gen = torch.Generator(device=DEV).manual_seed(1)
    for hidden, pad in ((4096, 8), (1000, 3)):  # aligned stride: 16-byte path; odd stride: scalar path
        base = rand(9, hidden + pad, dtype=dtype, gen=gen)
        x = base[:, :hidden]
        w = rand(hidden, dtype=dtype, gen=gen)
        assert_within_one_ulp(cuda_ops.rms_norm(x, w, EPS), ref.rms_norm(x.contiguous(), w, EPS))


@pytest.mark.parametrize("dtype", HALF_TYPES + [torch.float32])
@pytest.mark.parametrize("hidden", NORM_WIDTHS)
def test_fused_add_rms_norm_matches_reference(dtype, hidden):
    gen = torch.Generator(device=DEV).manual_seed(hidden + 7)
    t = 13
    x = rand(t, hidden, dtype=dtype, gen=gen, scale=2.0)
    res = rand(t, hidden, dtype=dtype, gen=gen, scale=4.0)
    w = rand(hidden, dtype=dtype, gen=gen)
    x_ref, res_ref = ref.fused_add_rms_norm(x.clone(), res.clone(), w, EPS)
    x_out, res_out = cuda_ops.fused_add_rms_norm(x, res, w, EPS)
    assert x_out.data_ptr() == x.data_ptr() and res_out.data_ptr() == res.data_ptr()  # in place
    assert_bits_equal(res_out, res_ref)  # one add, one rounding: exact
    assert_norm_close(x_out, x_ref)


@pytest.mark.parametrize("dtype", HALF_TYPES)
def test_norms_are_batch_invariant(dtype):
    gen = torch.Generator(device=DEV).manual_seed(3)
    hidden, t = 4096, 37
    x = rand(t, hidden, dtype=dtype, gen=gen)
    res = rand(t, hidden, dtype=dtype, gen=gen)
    w = rand(hidden, dtype=dtype, gen=gen)
    batch = cuda_ops.rms_norm(x, w, EPS)
    x_b, res_b = cuda_ops.fused_add_rms_norm(x.clone(), res.clone(), w, EPS)
    for i in (0, 17, t - 1):
        assert_bits_equal(cuda_ops.rms_norm(x[i:i + 1].clone(), w, EPS), batch[i:i + 1])
        x_1, res_1 = cuda_ops.fused_add_rms_norm(x[i:i + 1].clone(), res[i:i + 1].clone(), w, EPS)
        assert_bits_equal(x_1, x_b[i:i + 1])
        assert_bits_equal(res_1, res_b[i:i + 1])


# ---- silu_and_mul -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", HALF_TYPES + [torch.float32])
@pytest.mark.parametrize("inter", [1536, 14336, 7, 1000])
def test_silu_and_mul_matches_reference(dtype, inter):
    gen = torch.Generator(device=DEV).manual_seed(inter)
    for t in (1, 5, 64):
        x = rand(t, 2 * inter, dtype=dtype, gen=gen, scale=3.0)
        out = cuda_ops.silu_and_mul(x)
        expected = ref.silu_and_mul(x)
        if dtype == torch.float32:
            torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
        else:
            assert_within_one_ulp(out, expected)


@pytest.mark.parametrize("dtype", HALF_TYPES)
def test_silu_and_mul_strided_rows_and_batch_invariance(dtype):
    gen = torch.Generator(device=DEV).manual_seed(5)
    inter = 1536
    base = rand(11, 2 * inter + 16, dtype=dtype, gen=gen)
    x = base[:, : 2 * inter]  # rows 2I + 16 apart
    batch = cuda_ops.silu_and_mul(x)
    assert_within_one_ulp(batch, ref.silu_and_mul(x.contiguous()))
    for i in (0, 6, 10):
        assert_bits_equal(cuda_ops.silu_and_mul(x[i:i + 1].clone()), batch[i:i + 1])


# ---- rope_and_cache -------------------------------------------------------------------------------


def rope_tables(positions: torch.Tensor, head_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [T, D] as LlamaForCausalLM builds them (rotate_half's sign folded into sin)."""
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=DEV) / head_dim))
    emb = torch.outer(positions.to(torch.float64), inv_freq).repeat(1, 2)
    sin = emb.sin()
    sin[:, : head_dim // 2] *= -1
    return emb.cos().to(dtype), sin.to(dtype)


def rope_case(t: int, hq: int, hkv: int, d: int, dtype: torch.dtype, seed: int, num_blocks: int = 12,
              block_size: int = 16, skip_every: int = 3):
    """qkv [T, (Hq + 2 Hkv) D] as the qkv GEMM writes it, with the views llama.py passes; NaN caches;
    distinct slots from a shuffled pool, every skip_every-th token -1."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    qkv = rand(t, (hq + 2 * hkv) * d, dtype=dtype, gen=gen, scale=2.0)
    positions = torch.randint(0, 4000, (t,), generator=gen, device=DEV)
    cos, sin = rope_tables(positions, d, dtype)
    perm = torch.randperm(num_blocks * block_size, generator=gen, device=DEV)[:t]
    slots = torch.where(torch.arange(t, device=DEV) % skip_every == 1, torch.full_like(perm, -1), perm)
    cache_shape = (num_blocks, block_size, hkv, d)
    k_cache = torch.full(cache_shape, float("nan"), dtype=dtype, device=DEV)
    v_cache = torch.full(cache_shape, float("nan"), dtype=dtype, device=DEV)
    return qkv, cos, sin, k_cache, v_cache, slots


def views(qkv: torch.Tensor, hq: int, hkv: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    t = qkv.shape[0]
    return qkv[:, : (hq + hkv) * d].view(t, hq + hkv, d), qkv[:, (hq + hkv) * d:].view(t, hkv, d)


# (Hq, Hkv, D): Llama-3-8B; SmolLM2; head_dim 72 (36 per half: one-element path); MQA with D = 256.
ROPE_SHAPES = [(32, 8, 128), (9, 3, 64), (5, 1, 72), (4, 1, 256)]


@pytest.mark.parametrize("dtype", HALF_TYPES + [torch.float32])
@pytest.mark.parametrize("shape", ROPE_SHAPES)
@pytest.mark.parametrize("rotate", [True, False])
def test_rope_and_cache_matches_reference_bit_for_bit(dtype, shape, rotate):
    hq, hkv, d = shape
    for t in (1, 10):
        qkv, cos, sin, k_cache, v_cache, slots = rope_case(t, hq, hkv, d, dtype, seed=t * 100 + d)
        if not rotate:
            cos = sin = None
        qkv_ref, kc_ref, vc_ref = qkv.clone(), k_cache.clone(), v_cache.clone()
        ref.rope_and_cache(*views(qkv_ref, hq, hkv, d), cos, sin, kc_ref, vc_ref, slots)
        qk, v = views(qkv, hq, hkv, d)
        assert t == 1 or qk.stride(0) == (hq + 2 * hkv) * d  # strided rows, as llama.py passes them
        cuda_ops.rope_and_cache(qk, v, cos, sin, k_cache, v_cache, slots)
        assert_bits_equal(qkv, qkv_ref)  # q and k rotated in place, v untouched
        assert_bits_equal(k_cache, kc_ref)  # written slots, and every other slot still NaN
        assert_bits_equal(v_cache, vc_ref)
        written = slots[slots >= 0]
        assert not torch.isnan(k_cache.view(-1, hkv, d)[written]).any()


@pytest.mark.parametrize("dtype", HALF_TYPES)
def test_rope_and_cache_skipped_slots_write_nothing(dtype):
    hq, hkv, d = 32, 8, 128
    qkv, cos, sin, k_cache, v_cache, slots = rope_case(6, hq, hkv, d, dtype, seed=9, skip_every=1)
    slots.fill_(-1)  # padding rows of a CUDA graph: still rotated, no KV written
    qkv_ref = qkv.clone()
    ref.rope_and_cache(*views(qkv_ref, hq, hkv, d), cos, sin, k_cache.clone(), v_cache.clone(), slots)
    cuda_ops.rope_and_cache(*views(qkv, hq, hkv, d), cos, sin, k_cache, v_cache, slots)
    assert_bits_equal(qkv, qkv_ref)
    assert bool(torch.isnan(k_cache).all()) and bool(torch.isnan(v_cache).all())


@pytest.mark.parametrize("dtype", HALF_TYPES)
def test_rope_and_cache_is_batch_invariant(dtype):
    hq, hkv, d, t = 32, 8, 128, 9
    qkv, cos, sin, k_cache, v_cache, slots = rope_case(t, hq, hkv, d, dtype, seed=11)
    qkv_one, kc_one, vc_one = qkv.clone(), k_cache.clone(), v_cache.clone()
    cuda_ops.rope_and_cache(*views(qkv, hq, hkv, d), cos, sin, k_cache, v_cache, slots)
    for i in range(t):
        row = qkv_one[i:i + 1]
        cuda_ops.rope_and_cache(*views(row, hq, hkv, d), cos[i:i + 1], sin[i:i + 1], kc_one, vc_one, slots[i:i + 1])
    assert_bits_equal(qkv_one, qkv)
    assert_bits_equal(kc_one, k_cache)
    assert_bits_equal(vc_one, v_cache)


def test_layer_ops_capture_in_a_cuda_graph():
    """The decode step replays these ops from a CUDA graph: capture one layer's worth and replay
    it on new inputs copied into the static buffers."""
    dtype, hq, hkv, d, hidden, inter = torch.bfloat16, 8, 2, 64, 512, 256
    gen = torch.Generator(device=DEV).manual_seed(13)
    x = rand(4, hidden, dtype=dtype, gen=gen)
    res = rand(4, hidden, dtype=dtype, gen=gen)
    w = rand(hidden, dtype=dtype, gen=gen)
    gate_up = rand(4, 2 * inter, dtype=dtype, gen=gen)
    qkv, cos, sin, k_cache, v_cache, slots = rope_case(4, hq, hkv, d, dtype, seed=13)

    def step():
        cuda_ops.fused_add_rms_norm(x, res, w, EPS)
        cuda_ops.rope_and_cache(*views(qkv, hq, hkv, d), cos, sin, k_cache, v_cache, slots)
        return cuda_ops.rms_norm(x, w, EPS), cuda_ops.silu_and_mul(gate_up)

    step()  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        normed, act = step()
    new = [rand(*t.shape, dtype=dtype, gen=gen) for t in (x, res, gate_up, qkv)]
    x_ref, res_ref = ref.fused_add_rms_norm(new[0].clone(), new[1].clone(), w, EPS)
    qkv_ref = new[3].clone()
    ref.rope_and_cache(*views(qkv_ref, hq, hkv, d), cos, sin, k_cache.clone(), v_cache.clone(), slots)
    for dst, src in zip((x, res, gate_up, qkv), new):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    assert_bits_equal(res, res_ref)
    assert_within_one_ulp(x, x_ref)
    assert_within_one_ulp(normed, ref.rms_norm(x, w, EPS))
    assert_within_one_ulp(act, ref.silu_and_mul(new[2]))
    assert_bits_equal(qkv, qkv_ref)


def test_unsupported_dtypes_fall_back_to_the_reference():
    gen = torch.Generator(device=DEV).manual_seed(17)
    x = rand(3, 64, dtype=torch.float64, gen=gen)
    w = rand(64, dtype=torch.float64, gen=gen)
    torch.testing.assert_close(cuda_ops.rms_norm(x, w, EPS), ref.rms_norm(x, w, EPS))
    # mixed dtypes (fp32 weight on bf16 activations): the reference's semantics, not a cast
    xb = x.to(torch.bfloat16)
    assert_bits_equal(cuda_ops.rms_norm(xb, w.float(), EPS), ref.rms_norm(xb, w.float(), EPS))


@pytest.mark.parametrize("dtype", HALF_TYPES)
def test_regression_lone_token_with_a_degenerate_stride_gets_the_batched_bits(dtype):
    """A one-token [1, H] view of a transposed table (llama.py's tied embedding) has stride (1, 1):
    the norms took their one-element path for it, so a request alone (batch 1 decode) summed in
    another order than in a batch and drifted by a few bf16 ulps (found by
    tests/test_batch_invariance_gpu.py on the H100)."""
    g = torch.Generator(device=DEV).manual_seed(3)
    table = torch.randn(576, 64, device=DEV, generator=g).to(dtype)
    weight = torch.randn(576, device=DEV, generator=g).to(dtype)
    lone = table.index_select(1, torch.tensor([5], device=DEV)).t().contiguous()
    pair = table.index_select(1, torch.tensor([5, 9], device=DEV)).t().contiguous()
    assert lone.stride() == (1, 1) and pair.stride() == (576, 1)  # the layouts llama.py produces
    assert torch.equal(ops.rms_norm(lone, weight, EPS), ops.rms_norm(pair, weight, EPS)[:1])
    x1 = torch.randn(1, 576, device=DEV, generator=g).to(dtype)
    x2 = torch.cat([x1, torch.randn(1, 576, device=DEV, generator=g).to(dtype)])
    residual1 = table.index_select(1, torch.tensor([5], device=DEV)).t().contiguous()  # stride (1, 1) again
    out1, res1 = ops.fused_add_rms_norm(x1, residual1, weight, EPS)
    out2, res2 = ops.fused_add_rms_norm(x2, pair.clone(), weight, EPS)
    assert torch.equal(out1, out2[:1]) and torch.equal(res1, res2[:1])
