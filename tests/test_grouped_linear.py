"""ops.grouped_linear on the CPU (its reference: each group through linear()) and the model code
that calls it under KernelConfig.batch_invariant: the MoE's grouped path, DeepSeek's per-head
projections, and the routing tie rule. The CUDA kernel itself: tests/test_grouped_gemm_gpu.py."""
from __future__ import annotations

import pytest
import torch

from pyengine import ops
from pyengine.models.deepseek_v3 import per_head_linear
from pyengine.models.moe import MoE, MoEConfig, route, top_indices
from pyengine.ops.kernel_config import use_kernel_config


def grouped_operands(counts: list[int], k: int = 24, n: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(counts), k, generator=g)
    w = torch.randn(len(counts), k, n, generator=g)
    offs = torch.tensor(counts, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return x, w, offs


def test_offsets_form_multiplies_each_row_by_its_groups_weight() -> None:
    counts = [3, 0, 1, 7, 0, 2]  # empty and one-row groups
    x, w, offs = grouped_operands(counts)
    group_of_row = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    want = torch.einsum("rk,rkn->rn", x.double(), w.double()[group_of_row])
    got = ops.grouped_linear(x, w, offs)
    assert got.shape == (sum(counts), w.shape[2])
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_equal_groups_form_takes_strided_heads() -> None:
    g = torch.Generator().manual_seed(1)
    q = torch.randn(5, 3, 40, generator=g)
    x = q[:, :, :32]  # a strided [T, H, in] view, as q_nope of MLA
    w = torch.randn(3, 32, 8, generator=g)
    got = ops.grouped_linear(x, w)
    assert got.shape == (5, 3, 8)
    torch.testing.assert_close(got, torch.bmm(x.transpose(0, 1), w).transpose(0, 1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("args,match", [
    (lambda x, w, o: (x, w[0], o), "w \\[G, in, out\\]"),
    (lambda x, w, o: (x[:, :8], w, o), "w \\[G, in, out\\]"),
    (lambda x, w, o: (x, w, None), "w \\[G, in, out\\]"),
    (lambda x, w, o: (x, w, o.long()), "offs must be int32"),
    (lambda x, w, o: (x, w, o[:-1]), "offs must be int32"),
    (lambda x, w, o: (x[:4].view(2, 2, -1), w, None), "G = 3 groups"),
    (lambda x, w, o: (x.double(), w, o), "one dtype"),
])
def test_validation_errors(args, match: str) -> None:
    x, w, offs = grouped_operands([2, 1, 3])
    with pytest.raises(ValueError, match=match):
        ops.grouped_linear(*args(x, w, offs))


def test_route_ties_go_to_the_lower_index() -> None:
    """Equal scores: the lower expert (and the lower group) wins, for every row of any batch."""
    cfg = MoEConfig(num_experts=8, top_k=2, n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=1.0,
                    n_shared_experts=0, moe_intermediate_size=8)
    logits = torch.zeros(3, 8)
    logits[1, [5, 6]] = 1.0  # groups 2 and 3 tie, experts 5 and 6 tie
    logits[2] = torch.tensor([0.0, 0.0, 3.0, 3.0, 3.0, 3.0, 0.0, 0.0])  # groups 1 and 2 tie; four experts tie
    ids, _ = route(logits, None, cfg)
    assert ids.tolist() == [[0, 1], [5, 6], [2, 3]]
    for r in range(3):
        assert torch.equal(route(logits[r:r + 1], None, cfg)[0], ids[r:r + 1])
    assert top_indices(torch.tensor([[1.0, 2.0, 2.0, 0.5]]), 3).tolist() == [[1, 2, 0]]


def small_moe(hidden: int = 16, inter: int = 8) -> MoE:
    cfg = MoEConfig(num_experts=6, top_k=2, n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.5,
                    n_shared_experts=1, moe_intermediate_size=inter)
    moe = MoE(hidden, cfg, torch.float32)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return moe


def test_moe_grouped_path_under_batch_invariant_equals_per_expert() -> None:
    """The batch_invariant branch of MoE._grouped (ops.grouped_linear over expert-sorted rows, the
    output put back in (token, slot) order) computes what the per-expert loop computes."""
    moe = small_moe()
    x = torch.randn(9, 16, generator=torch.Generator().manual_seed(3))
    ids, _ = route(x @ moe.gate, moe.e_score_correction_bias, moe.cfg)
    with use_kernel_config(batch_invariant=True):
        grouped = moe._grouped(x, ids)
    torch.testing.assert_close(grouped, moe._per_expert(x, ids), rtol=1e-5, atol=1e-5)


def test_per_head_linear_runs_grouped_linear_under_batch_invariant(monkeypatch) -> None:
    calls = []
    grouped = ops.grouped_linear
    monkeypatch.setattr(ops, "grouped_linear", lambda x, w, offs=None: calls.append(1) or grouped(x, w, offs))
    x, w = torch.randn(4, 3, 16), torch.randn(3, 16, 8)
    plain = per_head_linear(x, w)
    assert not calls
    with use_kernel_config(batch_invariant=True):
        invariant = per_head_linear(x, w)
    assert calls
    torch.testing.assert_close(invariant, plain, rtol=1e-5, atol=1e-5)
