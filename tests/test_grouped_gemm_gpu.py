"""The grouped batch-invariant GEMM (hipkernels/gemm/grouped_gemm.hip) on the GPU: every row's
bits equal invariant_gemm of that row alone with its group's weight, whatever the other groups hold
(random counts with empty and one-row groups, shuffled and different batch compositions, every K
split and row tile), in both forms (rows sorted by group with device offsets; equal groups from a
strided [T, G, K] view); values agree with an fp32 reference; the MoE layer under batch_invariant
runs it and gives a token the same output alone and in a batch. Sizes stay small enough for
compute-sanitizer. Skips without CUDA and the kernels."""
from __future__ import annotations

import pytest
import torch

try:
    from pyengine.ops import cuda as cuda_ops
    from pyengine.ops.cuda.launch import aligned_rows, kernels, num_sms, params, row_stride, stream
except ImportError:  # no GPU kernels in this build
    cuda_ops = None

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or cuda_ops is None, reason="needs CUDA and the GPU kernels")]

# (K, N): W_UK-like, W_UV-like, expert down / gate_up shapes (default splits 1, 1, 1, 4, 2 on an H100;
# test_every_split_and_fp16 forces each)
SHAPES = [(128, 512), (512, 64), (256, 384), (2048, 128), (1024, 1024)]


def invariant_gemm(x: torch.Tensor, w: torch.Tensor, split: int = 0) -> torch.Tensor:
    """The dense invariant GEMM of the mma.sync family (InvariantGemmParams.family = 1): the
    grouped GEMM's tile kernel over one matrix."""
    x = aligned_rows(x)
    y = torch.empty(x.shape[0], w.shape[1], dtype=x.dtype, device=x.device)
    p = params(kernels.InvariantGemmParams, x=x.data_ptr(), w=w.data_ptr(), y=y.data_ptr(), m=x.shape[0], n=w.shape[1],
               k=x.shape[1], x_stride=row_stride(x), y_stride=row_stride(y), dtype=1 if x.dtype == torch.bfloat16 else 0,
               num_sms=num_sms(x.device), split=split, family=1)
    with torch.cuda.device(x.device):
        kernels.invariant_gemm(p, stream(x.device))
    return y


def grouped_alone(row: torch.Tensor, w_group: torch.Tensor, split: int = 0) -> torch.Tensor:
    """The grouped GEMM of one row in a launch of its own (one group, one row)."""
    return cuda_ops.grouped_gemm(row, w_group[None], torch.ones(1, dtype=torch.int32, device=row.device), split=split)


def generator(seed: int) -> torch.Generator:
    return torch.Generator(device="cuda").manual_seed(seed)


def random_counts(num_groups: int, total: int, seed: int) -> list[int]:
    """total rows over num_groups groups, skewed, with empty groups and (usually) one-row groups."""
    g = torch.Generator().manual_seed(seed)
    weights = torch.rand(num_groups, generator=g) ** 3
    weights[torch.randperm(num_groups, generator=g)[:num_groups // 4]] = 0  # empty groups
    counts = torch.multinomial(weights, total, replacement=True, generator=g)
    return torch.bincount(counts, minlength=num_groups).tolist()


def operands(k: int, n: int, counts: list[int], dtype: torch.dtype = torch.bfloat16, seed: int = 0):
    g = generator(seed)
    x = torch.randn(sum(counts), k, device="cuda", generator=g).to(dtype)
    w = (torch.randn(len(counts), k, n, device="cuda", generator=g) / k ** 0.5).to(dtype)
    offs = torch.tensor(counts, dtype=torch.int32, device="cuda").cumsum(0, dtype=torch.int32)
    return x, w, offs


def group_slices(counts: list[int]) -> list[tuple[int, int, int]]:
    out, begin = [], 0
    for g, c in enumerate(counts):
        out.append((g, begin, begin + c))
        begin += c
    return out


def assert_rows_are_invariant_gemms(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, counts: list[int],
                                    split: int = 0) -> None:
    """Each group's rows == the mma.sync invariant_gemm of those rows with the group's weight (itself
    M-invariant: tests/test_invariant_gemm_gpu.py), and a few rows == it and the grouped GEMM on the row alone."""
    for g, begin, end in group_slices(counts):
        if end == begin:
            continue
        want = invariant_gemm(x[begin:end], w[g], split=split)
        assert torch.equal(y[begin:end], want), f"group {g} ({end - begin} rows)"
        for r in {begin, end - 1}:
            assert torch.equal(y[r:r + 1], invariant_gemm(x[r:r + 1], w[g], split=split)), f"row {r} alone"
            assert torch.equal(y[r:r + 1], grouped_alone(x[r:r + 1], w[g], split=split)), f"row {r} grouped alone"


def close_to_reference(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, counts: list[int]) -> None:
    group_of_row = torch.repeat_interleave(torch.arange(len(counts), device="cuda"),
                                           torch.tensor(counts, device="cuda"))
    ref = torch.einsum("rk,rkn->rn", x.float(), w.float()[group_of_row])
    tol = 2 ** -7 if y.dtype == torch.bfloat16 else 2 ** -10  # one rounding plus fp32 reordering
    err = (y.float() - ref).abs() / (ref.abs() + 1.0)
    assert float(err.max()) <= 2 * tol, float(err.max())


@pytest.mark.parametrize("k,n", SHAPES)
@pytest.mark.parametrize("num_groups,total", [(8, 5), (16, 40), (8, 600), (4, 1500)])  # row tiles 16, 16, 64, 128
def test_rows_equal_invariant_gemm_alone(k: int, n: int, num_groups: int, total: int) -> None:
    counts = random_counts(num_groups, total, seed=k + n + total)
    x, w, offs = operands(k, n, counts, seed=total)
    y = cuda_ops.grouped_gemm(x, w, offs)
    close_to_reference(y, x, w, counts)
    assert_rows_are_invariant_gemms(y, x, w, counts)


@pytest.mark.parametrize("split", [1, 2, 4, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_split_and_fp16(split: int, dtype: torch.dtype) -> None:
    for total in (9, 700):  # cluster combine and (700 rows over 2 groups: BM 128) the sequential walk
        counts = random_counts(2 if total > 256 else 6, total, seed=split)
        x, w, offs = operands(2048, 256, counts, dtype, seed=split)
        y = cuda_ops.grouped_gemm(x, w, offs, split=split)
        close_to_reference(y, x, w, counts)
        assert_rows_are_invariant_gemms(y, x, w, counts, split=split)


def test_batch_composition_does_not_change_a_row() -> None:
    """A row's bits in batch A == in batch B, where B holds it beside other rows in other groups,
    with other counts, at another position, and in a launch of another row tile."""
    k, n, groups = 1024, 256, 32
    g = generator(7)
    pool = torch.randn(400, k, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(groups, k, n, device="cuda", generator=g) / k ** 0.5).to(torch.bfloat16)
    pool_group = torch.randint(0, groups, (400,), device="cuda", generator=g)
    results = []
    for seed, size in ((1, 300), (2, 12), (3, 120), (4, 1)):
        pick = torch.randperm(400, generator=torch.Generator().manual_seed(seed))[:size].cuda()
        pick = torch.cat([pick, torch.zeros(1, dtype=pick.dtype, device="cuda")])  # row 0 in every batch
        order = torch.argsort(pool_group[pick], stable=True)
        rows = pick[order]
        counts = torch.bincount(pool_group[rows], minlength=groups)
        y = cuda_ops.grouped_gemm(pool[rows], w, counts.cumsum(0).to(torch.int32))
        results.append({int(r): y[i] for i, r in enumerate(rows.tolist())})
    first = results[0]
    assert torch.equal(results[1][0], first[0]) and torch.equal(results[3][0], first[0])
    shared = 0
    for other in results[1:]:
        for r, v in other.items():
            if r in first:
                assert torch.equal(v, first[r]), f"pool row {r}"
                shared += 1
    assert shared > 10


def test_equal_groups_from_a_strided_view() -> None:
    """Per-head form: x [T, H, K] a slice of a wider last dim (MLA's q_nope) -> [T, H, N]; head h's
    rows == invariant_gemm(x[:, h], w[h]) for T across the 16/64/128-row tiles."""
    heads, k, n = 8, 128, 512
    g = generator(3)
    for t in (1, 5, 17, 300):
        q = torch.randn(t, heads, k + 64, device="cuda", generator=g).to(torch.bfloat16)
        w = (torch.randn(heads, k, n, device="cuda", generator=g) / k ** 0.5).to(torch.bfloat16)
        x = q[:, :, :k]
        y = cuda_ops.grouped_gemm(x, w)
        assert y.shape == (t, heads, n)
        for h in range(heads):
            assert torch.equal(y[:, h], invariant_gemm(x[:, h], w[h])), f"T={t} head {h}"
        assert torch.equal(cuda_ops.grouped_gemm(x[-1:], w), y[-1:])


def test_empty_and_degenerate_launches() -> None:
    x, w, offs = operands(256, 128, [0, 0, 0, 3, 0])
    y = cuda_ops.grouped_gemm(x, w, offs)
    assert torch.equal(y, invariant_gemm(x, w[3]))
    none = cuda_ops.grouped_gemm(x[:0], w, torch.zeros(5, dtype=torch.int32, device="cuda"))
    assert none.shape == (0, 128)
    partial = cuda_ops.grouped_gemm(x, w, torch.tensor([0, 0, 0, 2, 2], dtype=torch.int32, device="cuda"))
    assert torch.equal(partial[:2], y[:2])  # rows past offs[-1] are not computed


def test_facade_runs_the_kernel_and_loops_for_fp32(monkeypatch) -> None:
    from pyengine import ops

    counts = [4, 0, 9, 1]
    x, w, offs = operands(256, 64, counts)
    launched = []
    kernel = cuda_ops.gemm.kernels.grouped_gemm
    monkeypatch.setattr(cuda_ops.gemm.kernels, "grouped_gemm", lambda *a: launched.append(1) or kernel(*a))
    assert torch.equal(ops.grouped_linear(x, w, offs), cuda_ops.grouped_gemm(x, w, offs)) and launched
    with pytest.raises(ValueError, match="multiple of 64"):
        ops.grouped_linear(x[:, :96].contiguous(), w[:, :96].contiguous(), offs)
    y32 = ops.grouped_linear(x.float(), w.float(), offs)  # no fp32 kernel: group by group
    close_to_reference(y32.to(torch.bfloat16), x, w, counts)


@pytest.mark.parametrize("style", ["deepseek_v3", "qwen3_next"])
def test_moe_token_alone_equals_in_a_batch(style: str) -> None:
    """A MoE layer under batch_invariant (fp32 router through the invariant fp32 GEMM, grouped
    experts, slot-ordered combine; DeepSeek-V3's sigmoid group-limited routing, or Qwen3-Next's
    softmax routing with a gated shared expert): each token's output is the same alone and in a
    batch of 37 that routes other tokens to its experts."""
    from pyengine.models.moe import MoE, MoEConfig
    from pyengine.ops.kernel_config import use_kernel_config

    if style == "deepseek_v3":
        cfg = MoEConfig(num_experts=16, top_k=4, n_group=4, topk_group=2, norm_topk_prob=True,
                        routed_scaling_factor=2.5, n_shared_experts=1, moe_intermediate_size=128)
    else:
        cfg = MoEConfig(num_experts=16, top_k=4, n_group=1, topk_group=1, norm_topk_prob=True,
                        routed_scaling_factor=1.0, n_shared_experts=1, moe_intermediate_size=128,
                        scoring_func="softmax", correction_bias=False, shared_intermediate_size=192,
                        shared_expert_gate=True)
    moe = MoE(256, cfg, torch.bfloat16).cuda()
    g = generator(11)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, device="cuda", generator=g) * 0.1)
    x = torch.randn(37, 256, device="cuda", generator=g).to(torch.bfloat16)
    with use_kernel_config(batch_invariant=True), torch.inference_mode():
        assert moe._runs_grouped(x)
        batch = moe(x)
        for t in (0, 5, 36):
            assert torch.equal(moe(x[t:t + 1]), batch[t:t + 1]), f"token {t}"
        assert torch.equal(moe(x[10:30]), batch[10:30])
