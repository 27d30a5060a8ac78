"""Batch-invariant split-KV GQA attention (KernelConfig.batch_invariant: params.fixed_splits,
hipkernels/attention/paged_attention.h): a query's keys are summed in ranges of SPLIT_BLOCK keys at
fixed boundaries and the ranges merged in range order, through the workspace and the combine
(decode and verify rows) or inside the block (prefill chunks). Rule checked: each query's output
and lse are bit-identical however the query arrives - decoded alone, inside verify rows of 2..16
tokens, inside prefill chunks of 17 / 100 / 600 tokens cut at different places, in a batch with
other rows of other lengths, replayed from a CUDA graph - for contexts around and across several
range boundaries, block sizes 16 and 1, both GQA kernels; and the result matches the reference.
"""
from __future__ import annotations

import pytest
import torch

from pyengine import ops
from pyengine.engine.attention_metadata import AttentionMetadata
from pyengine.ops import reference
from pyengine.ops.kernel_config import use_kernel_config

try:
    from pyengine.ops import cuda as cuda_ops
    from pyengine.ops.cuda.attention import SPLIT_BLOCK as U
except ImportError:  # no GPU kernels in this build
    cuda_ops, U = None, 512

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or cuda_ops is None, reason="needs CUDA and the GPU kernels"),
]

DEV = "cuda"
SEQ = 9000  # one sequence; a row (end, q_len) holds its tokens end - q_len .. end - 1 (context end)
# query positions: contexts 1, U - 1, U, U + 1, 2U, 3U + 7, 9000 and some around them
CONTEXTS = [1, 2, U - 1, U, U + 1, 2 * U, 2 * U + 1, 3 * U + 7, 3 * U + 8, SEQ - 1, SEQ]


class Sequence:
    """K/V of one SEQ-token sequence in a paged cache (shuffled blocks, NaN elsewhere) and a query
    for every position, Llama-3-8B heads (32 / 8, head dim 128) or a second shape."""

    def __init__(self, block_size: int, hkv: int, group: int, d: int, seed: int = 0):
        gen = torch.Generator(device=DEV).manual_seed(seed)
        self.bs, self.d = block_size, d
        nblk = (SEQ + block_size - 1) // block_size
        perm = torch.randperm(nblk + 5, generator=torch.Generator().manual_seed(seed))[:nblk]
        self.table = perm.to(torch.int32)
        shape = (nblk + 5, block_size, hkv, d)
        self.k = torch.full(shape, float("nan"), dtype=torch.bfloat16, device=DEV)
        self.v = torch.full_like(self.k, float("nan"))
        pos = torch.arange(SEQ)
        slots = (self.table.long()[pos // block_size] * block_size + pos % block_size).to(DEV)
        self.k.view(-1, hkv, d)[slots] = torch.randn(SEQ, hkv, d, generator=gen, device=DEV).bfloat16()
        self.v.view(-1, hkv, d)[slots] = torch.randn(SEQ, hkv, d, generator=gen, device=DEV).bfloat16()
        self.q = torch.randn(SEQ, hkv * group, d, generator=gen, device=DEV).bfloat16()

    def meta(self, rows: list[tuple[int, int]]) -> AttentionMetadata:
        qsl = [0]
        for _, q_len in rows:
            qsl.append(qsl[-1] + q_len)
        tables = self.table.unsqueeze(0).expand(len(rows), -1).contiguous().to(DEV)
        return AttentionMetadata(
            slot_mapping=torch.full((qsl[-1],), -1, dtype=torch.int64, device=DEV), block_tables=tables,
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=DEV),
            context_lens=torch.tensor([e for e, _ in rows], dtype=torch.int32, device=DEV),
            max_query_len=max(q for _, q in rows), max_context_len=max(e for e, _ in rows), block_size=self.bs)

    def run(self, rows: list[tuple[int, int]], ref: bool = False):
        """out, lse of the rows' tokens (in row order), and the position of each token."""
        meta = self.meta(rows)
        positions = torch.cat([torch.arange(e - n, e) for e, n in rows])
        q = self.q[positions.to(DEV)].contiguous()
        scale = self.d ** -0.5
        if ref:
            out, lse = reference.paged_attention(q, torch.nan_to_num(self.k), torch.nan_to_num(self.v), meta, scale,
                                                 return_lse=True)
        else:
            out, lse = ops.paged_attention(q, self.k, self.v, meta, scale, return_lse=True)
        return out, lse, positions.tolist()


def layouts(ctx: int) -> list[tuple[int, int]]:
    """Rows holding the query of context ctx (position ctx - 1): verify rows of 2..16 tokens and
    prefill chunks of 17 / 100 / 600 tokens, the query first, last or inside."""
    rows = []
    for q_len in (2, 3, 5, 16, 17, 100, 600):
        for after in sorted({0, 1, q_len // 2, q_len - 1}):
            end = ctx + after
            if end - q_len >= 0 and end <= SEQ and after < q_len:
                rows.append((end, q_len))
    return rows


@pytest.fixture(params=["mma", "fma"])
def gqa_kernel(request):
    with use_kernel_config(gqa_fma=request.param == "fma", batch_invariant=True):
        yield request.param


@pytest.fixture(scope="module", params=[(16, 8, 4, 128), (1, 8, 4, 128), (16, 2, 8, 64)],
                ids=["bs16", "bs1", "d64"])
def seq(request):
    return Sequence(*request.param)


def check_rows(seq, truth, rows, **kw):
    out, lse, positions = seq.run(rows, **kw)
    checked = 0
    for t, p in enumerate(positions):
        if p + 1 in truth:
            o1, l1 = truth[p + 1]
            assert torch.equal(out[t], o1) and torch.equal(lse[t], l1), f"context {p + 1} in rows {rows}"
            checked += 1
    return checked


@pytest.mark.usefixtures("gqa_kernel")
def test_query_bits_do_not_depend_on_the_row_or_the_batch(seq):
    truth = {}
    for ctx in CONTEXTS:  # (a) alone as a decode row
        out, lse, _ = seq.run([(ctx, 1)])
        assert not torch.isnan(out).any()
        truth[ctx] = (out[0], lse[0])
    all_rows = []
    for ctx in CONTEXTS:  # (b), (c): each row alone
        rows = layouts(ctx)
        all_rows += rows
        for row in rows:
            assert check_rows(seq, truth, [row]) >= 1
    # (d) in batches: everything at once, and decode / verify rows among other rows of other lengths
    assert check_rows(seq, truth, all_rows + [(4000, 1), (77, 30)]) >= len(all_rows)
    small = [r for r in all_rows if r[1] <= 16]
    assert check_rows(seq, truth, [(3000, 1), (6000, 4)] + small[::2] + [(20, 20)]) > 0
    assert check_rows(seq, truth, [(c, 1) for c in reversed(CONTEXTS)]) == len(CONTEXTS)


@pytest.mark.usefixtures("gqa_kernel")
def test_matches_reference(seq):
    rows = [(1, 1), (U + 1, 3), (3 * U + 7, 16), (SEQ, 1), (2 * U + 30, 600), (U + 5, 17), (100, 100)]
    out, lse, _ = seq.run(rows)
    ref, ref_lse, _ = seq.run(rows, ref=True)
    torch.testing.assert_close(out.float(), ref.float(), atol=5e-2, rtol=5e-2)
    torch.testing.assert_close(lse, ref_lse.float(), atol=1e-3, rtol=1e-3)


@pytest.mark.usefixtures("gqa_kernel")
def test_graph_replay_equals_eager(seq):
    """Decode and verify rows (workspace + combine) captured in a CUDA graph, max_context_len an
    upper bound as the engine's graphs have it: the replay gives the eager bits."""
    rows = [(SEQ, 1), (3 * U + 7, 5), (U, 16), (1, 1)]
    meta = seq.meta(rows)
    meta.max_context_len = SEQ + 4 * U
    positions = torch.cat([torch.arange(e - n, e) for e, n in rows]).to(DEV)
    q = seq.q[positions].contiguous()
    eager, eager_lse = ops.paged_attention(q, seq.k, seq.v, seq.meta(rows), seq.d ** -0.5, return_lse=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = ops.paged_attention(q, seq.k, seq.v, meta, seq.d ** -0.5, return_lse=True)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager) and torch.equal(lse, eager_lse)


@pytest.mark.usefixtures("gqa_kernel")
def test_prefill_graph_shape_keeps_each_querys_bits(seq):
    """A prefill graph's step (CudaGraphRunner stages it so): a 300-token prompt chunk beside decode
    and verify rows, then padding rows without keys owning the token slots after the step's (one
    of them most of them), max_context_len an upper bound. The launch numbers only the rows' own
    query tiles (flat tiles: max_num_tokens); eager and replayed, each query keeps its decode-alone bits."""
    truth = {}
    for ctx in CONTEXTS:
        out, lse, _ = seq.run([(ctx, 1)])
        truth[ctx] = (out[0], lse[0])
    rows = [(c, 1) for c in CONTEXTS[:6]] + [(U + 1, 3), (SEQ, 5), (3 * U + 7, 300)]
    n = sum(q for _, q in rows)
    slots = 1024  # the graph's token capacity: padding rows own the rest
    meta = seq.meta(rows + [(0, slots - n - 2), (0, 2), (0, 0), (0, 0)])
    meta.max_query_len, meta.max_context_len = slots, SEQ + 4 * U
    positions = torch.cat([torch.arange(e - q, e) for e, q in rows]).to(DEV)
    gen = torch.Generator(device=DEV).manual_seed(5)
    q = torch.cat([seq.q[positions], torch.randn(slots - n, *seq.q.shape[1:], generator=gen, device=DEV).bfloat16()])
    eager, eager_lse = ops.paged_attention(q, seq.k, seq.v, meta, seq.d ** -0.5, return_lse=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = ops.paged_attention(q, seq.k, seq.v, meta, seq.d ** -0.5, return_lse=True)
    graph.replay()
    torch.cuda.synchronize()
    checked = 0
    for t, p in enumerate(positions.tolist()):
        if p + 1 in truth:
            o1, l1 = truth[p + 1]
            for o, l, how in ((eager, eager_lse, "eager"), (out, lse, "replayed")):
                assert torch.equal(o[t], o1) and torch.equal(l[t], l1), f"context {p + 1}, {how}"
            checked += 1
    assert checked >= 9
    assert torch.all(eager[n:] == 0) and torch.all(torch.isinf(eager_lse[n:])), "padding slots attend to no key"


def test_default_mode_keeps_its_split_rule():
    """Without batch_invariant the rule stays per row (<= 16 splits): a query of a verify row and
    the same query in a prefill chunk differ (prefill rows never split), which the fixed rule fixes."""
    s = Sequence(16, 8, 4, 128, seed=3)
    row_v, row_p = (5000, 4), (5000, 40)
    with use_kernel_config(batch_invariant=False):
        ov, lv, _ = s.run([row_v])
        op, lp, _ = s.run([row_p])
    assert not (torch.equal(ov, op[-4:]) and torch.equal(lv, lp[-4:]))
    with use_kernel_config(batch_invariant=True):
        ov, lv, _ = s.run([row_v])
        op, lp, _ = s.run([row_p])
    assert torch.equal(ov[-1], op[-1]) and torch.equal(lv[-1], lp[-1])
