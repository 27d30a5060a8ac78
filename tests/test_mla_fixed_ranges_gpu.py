"""MLA attention on fixed key ranges (hipkernels/attention/mla_ranges.h, KernelConfig.batch_invariant):
a query's keys are summed in ranges of SPLIT_BLOCK keys, each from a fresh state, merged in range
order; the step only chooses which block computes a range (one block per range + the combine, or one
block walking the row's ranges: pyengine/ops/cuda/mla.py walk_pays, force_walk). Checked: every assignment gives the same bits;
a query's output and lse are bit-identical however it arrives (decoded alone, in verify rows of 2..16
tokens, in prefill chunks of 17 / 100 tokens, in a mixed batch, replayed from a CUDA graph), for
contexts around range boundaries, block sizes 1 / 16 / 64, 128 and 16 heads, both tiles; and the
kernel matches the reference. The reference of the formulation (reference.mla.paged_attention_mla_
ranges) is checked against the plain softmax on the CPU.
"""
from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys

import pytest
import torch

from pyengine import ops
from pyengine.engine.attention_metadata import AttentionMetadata
from pyengine.ops import reference
from pyengine.ops.kernel_config import use_kernel_config
from pyengine.ops.reference.mla import paged_attention_mla_ranges

try:
    from pyengine.ops import cuda as cuda_ops
    from pyengine.ops.cuda import mla as cuda_mla
    from pyengine.ops.cuda.attention import SPLIT_BLOCK as U
except ImportError:  # no GPU kernels in this build
    cuda_ops, cuda_mla, U = None, None, 512

gpu = pytest.mark.skipif(not torch.cuda.is_available() or cuda_ops is None, reason="needs CUDA and the GPU kernels")
SEQ = 2100  # one sequence; a row (end, q_len) holds its tokens end - q_len .. end - 1 (context end)
CONTEXTS = [1, 2, U - 1, U, U + 1, 2 * U, 2 * U + 1, 3 * U + 7, SEQ - 1, SEQ]


def step_meta(rows: list[tuple[int, int]], table: list[int], block_size: int, device) -> AttentionMetadata:
    """Every row reads the one sequence's blocks (its first `end` keys)."""
    qsl = [0]
    for _, q_len in rows:
        qsl.append(qsl[-1] + q_len)
    return AttentionMetadata(
        slot_mapping=torch.full((qsl[-1],), -1, dtype=torch.int64, device=device),
        block_tables=torch.tensor([table] * len(rows), dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        context_lens=torch.tensor([end for end, _ in rows], dtype=torch.int32, device=device),
        max_query_len=max(q for _, q in rows), max_context_len=max(end for end, _ in rows), block_size=block_size)


class Sequence:
    """The latent cache of one SEQ-token sequence (shuffled blocks, NaN elsewhere) and a query for every
    position; run(rows) gives each row's tokens' (out, lse) keyed by position."""

    def __init__(self, block_size: int, heads: int, device="cuda", dtype=torch.bfloat16, seed: int = 0):
        gen = torch.Generator(device=device).manual_seed(seed)
        nblocks = (SEQ + block_size - 1) // block_size
        free = list(range(nblocks + 5))
        random.Random(seed).shuffle(free)
        self.table, self.block_size, self.device = free[:nblocks], block_size, device
        self.kv = torch.full((nblocks + 5, block_size, 576), float("nan"), dtype=dtype, device=device)
        pos = torch.arange(SEQ)
        slots = (torch.tensor(self.table)[pos // block_size] * block_size + pos % block_size).to(device)
        self.kv.view(-1, 576)[slots] = torch.randn(SEQ, 576, generator=gen, device=device).to(dtype)
        self.q = torch.randn(SEQ, heads, 576, generator=gen, device=device).to(dtype)

    def inputs(self, rows):
        meta = step_meta(rows, self.table, self.block_size, self.device)
        positions = [p for end, q_len in rows for p in range(end - q_len, end)]
        return meta, self.q[torch.tensor(positions, device=self.device)].contiguous(), positions

    def run(self, rows) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        meta, q, positions = self.inputs(rows)
        out, lse = ops.paged_attention_mla(q, self.kv, meta, 192 ** -0.5, return_lse=True)
        return {p: (out[i], lse[i]) for i, p in enumerate(positions)}


def arrangements(ctx: int) -> list[list[tuple[int, int]]]:
    """Steps holding the query of context ctx (position ctx - 1): alone, first / last in verify rows,
    inside prefill chunks, and a mixed batch of all of them with other rows."""
    steps = [[(ctx, 1)]]
    for q_len in (2, 5, 16, 17, 100):
        for end in (ctx, min(SEQ, ctx - 1 + q_len)):
            if end - q_len <= ctx - 1 < end and end - q_len >= 0:
                steps.append([(end, q_len)])
    steps.append([(SEQ, 3), (U + 1, 1)] + [r for s in steps[1:] for r in s] + [(7, 7), (ctx, 1), (1500, 16)])
    return steps


@pytest.fixture(params=["fast", "small"])
def mla_tile(request):
    with use_kernel_config(mla_small_tile=request.param == "small"):
        yield request.param


@pytest.fixture
def invariant():
    with use_kernel_config(batch_invariant=True):
        yield


@pytest.fixture(params=[None, True, False], ids=["auto", "walk", "split"])
def assignment(request, monkeypatch):
    if cuda_mla is not None:
        monkeypatch.setattr(cuda_mla, "force_walk", request.param)
    return request.param


@gpu
@pytest.mark.usefixtures("mla_tile")
@pytest.mark.parametrize("block_size, heads", [(64, 128), (16, 16), (1, 128)])
@pytest.mark.usefixtures("invariant")
def test_a_query_gets_the_same_bits_in_every_step_and_assignment(block_size, heads, monkeypatch):
    seq = Sequence(block_size, heads)
    for ctx in CONTEXTS:
        monkeypatch.setattr(cuda_mla, "force_walk", None)
        alone_out, alone_lse = seq.run([(ctx, 1)])[ctx - 1]
        assert torch.isfinite(alone_lse).all()
        for walk in (True, False):
            monkeypatch.setattr(cuda_mla, "force_walk", walk)
            for rows in arrangements(ctx):
                out, lse = seq.run(rows)[ctx - 1]
                assert torch.equal(out, alone_out) and torch.equal(lse, alone_lse), (ctx, walk, rows)


@gpu
@pytest.mark.usefixtures("mla_tile", "assignment")
@pytest.mark.parametrize("mode", ["default", "invariant"])
@pytest.mark.parametrize("heads", [128, 20])
def test_mla_matches_the_references(heads, mode, assignment):
    if mode == "default" and assignment:
        pytest.skip("walking every row is a batch_invariant assignment")
    seq = Sequence(16, heads, seed=heads)
    rows = [(40, 1), (700, 3), (9, 9), (SEQ, 6), (300, 30), (1025, 16), (U, 1), (U + 1, 2), (1536, 17)]
    meta, q, _ = seq.inputs(rows)
    with use_kernel_config(batch_invariant=mode == "invariant"):
        out, lse = ops.paged_attention_mla(q, seq.kv, meta, 192 ** -0.5, return_lse=True)
    kv = torch.nan_to_num(seq.kv)
    ref, ref_lse = paged_attention_mla_ranges(q, kv, meta, 192 ** -0.5, return_lse=True)
    plain, plain_lse = reference.paged_attention_mla(q, kv, meta, 192 ** -0.5, return_lse=True)
    assert not torch.isnan(out).any()
    for r_out, r_lse in ((ref, ref_lse), (plain, plain_lse)):
        torch.testing.assert_close(out.float(), r_out.float(), atol=5e-2, rtol=5e-2)
        torch.testing.assert_close(lse, r_lse.float(), atol=1e-3, rtol=1e-3)


@gpu
@pytest.mark.usefixtures("mla_tile", "invariant")
@pytest.mark.parametrize("factors", [(1, 1, 4, 1, 1), (24, 1, 1, 4, 1)], ids=["jump", "fall-and-jump"])
def test_ranges_far_above_or_below_the_merged_reference_keep_the_bits(factors, monkeypatch):
    """The merge's two branches (merge_range): a later range whose lse passes the merged reference by
    more than 2^8 rescales the state (the walk reads its slab), one far below it adds values that
    underflow (flushed to zero alike by the combine's add and the walk's red.add in the L2). Keys of
    range r are scaled by factors[r]; walking and split blocks give the same bits, decoded alone and
    in a batch, and match the references."""
    seq = Sequence(64, 128)
    pos = torch.arange(SEQ)
    slots = (torch.tensor(seq.table)[pos // 64] * 64 + pos % 64).to(seq.device)
    for r, f in enumerate(factors):
        rs = slots[r * U:(r + 1) * U]
        seq.kv.view(-1, 576)[rs] = (seq.kv.view(-1, 576)[rs].float() * f).to(seq.kv.dtype)
    for ctx in (3 * U + 7, SEQ):
        results = []
        for walk in (True, False):
            monkeypatch.setattr(cuda_mla, "force_walk", walk)
            results += [seq.run([(ctx, 1)])[ctx - 1], seq.run([(SEQ, 5), (ctx, 1), (U + 3, 2)])[ctx - 1]]
        for out, lse in results[1:]:
            assert torch.equal(out, results[0][0]) and torch.equal(lse, results[0][1]), ctx
    meta, q, _ = seq.inputs([(3 * U + 7, 1), (SEQ, 1)])
    out, lse = ops.paged_attention_mla(q, seq.kv, meta, 192 ** -0.5, return_lse=True)
    ref, ref_lse = reference.paged_attention_mla(q, torch.nan_to_num(seq.kv), meta, 192 ** -0.5, return_lse=True)
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.float(), ref.float(), atol=5e-2, rtol=5e-2)
    torch.testing.assert_close(lse, ref_lse.float(), atol=1e-3, rtol=1e-3)


@gpu
@pytest.mark.usefixtures("mla_tile")
def test_queries_without_keys_and_empty_rows(monkeypatch):
    """ctx 0 rows and the early queries of a row with ctx < q_len: out 0, lse +inf, in both assignments."""
    seq = Sequence(64, 128)
    for walk, mode in ((True, True), (False, True), (False, False)):
        monkeypatch.setattr(cuda_mla, "force_walk", walk)
        meta, q, _ = seq.inputs([(3, 3), (SEQ, 2)])
        meta.context_lens[0] = 1  # row 0: ctx 1, q_len 3: its first two queries see no key
        with use_kernel_config(batch_invariant=mode):
            out, lse = ops.paged_attention_mla(q, seq.kv, meta, 192 ** -0.5, return_lse=True)
        assert (out[:2] == 0).all() and torch.isinf(lse[:2]).all() and (lse[:2] > 0).all()
        assert torch.isfinite(lse[2:]).all() and not torch.isnan(out).any()


@gpu
@pytest.mark.usefixtures("invariant")
def test_graph_replay_and_repeated_walking_launches_give_the_same_bits(monkeypatch):
    """Walking blocks take accumulator slabs under locks: 30 launches of a step of many walking rows
    (more blocks than SMs, so slabs are reused within a launch) and a CUDA-graph replay all give the
    first launch's bits."""
    monkeypatch.setattr(cuda_mla, "force_walk", True)
    seq = Sequence(64, 128)
    rows = [(SEQ - 7 * i, 1 + i % 4) for i in range(100)]
    meta, q, _ = seq.inputs(rows)
    first, first_lse = ops.paged_attention_mla(q, seq.kv, meta, 192 ** -0.5, return_lse=True)
    for _ in range(30):
        out, lse = ops.paged_attention_mla(q, seq.kv, meta, 192 ** -0.5, return_lse=True)
        assert torch.equal(out, first) and torch.equal(lse, first_lse)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out, g_lse = ops.paged_attention_mla(q, seq.kv, meta, 192 ** -0.5, return_lse=True)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(g_out, first) and torch.equal(g_lse, first_lse)


@gpu
def test_default_mode_keeps_the_per_row_rule():
    """The default mode splits by the per-row rule (fewer, larger splits past 16 ranges) and merges
    with the default combine: other bits than the invariant mode, the same values to rounding."""
    seq = Sequence(64, 128)
    rows = [(SEQ, 1), (700, 4), (30, 1), (SEQ, 20)]
    meta, q, _ = seq.inputs(rows)
    default = ops.paged_attention_mla(q, seq.kv, meta, 192 ** -0.5, return_lse=True)
    with use_kernel_config(batch_invariant=True):
        invariant = ops.paged_attention_mla(q, seq.kv, meta, 192 ** -0.5, return_lse=True)
    torch.testing.assert_close(default[0].float(), invariant[0].float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(default[1], invariant[1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("range_size", [64, 512])
def test_range_reference_equals_the_plain_softmax(range_size):
    """CPU, fp64: the ranges' merge is exact arithmetic on the softmax, so the two references agree
    to rounding (also for queries without keys and rows of one range)."""
    seq = Sequence(16, 4, device="cpu", dtype=torch.float64, seed=3)
    rows = [(1, 1), (3, 3), (range_size, 2), (range_size + 1, 5), (SEQ, 20)]
    meta, q, _ = seq.inputs(rows)
    meta.context_lens[1] = 2  # a query without keys
    kv = torch.nan_to_num(seq.kv)
    out, lse = paged_attention_mla_ranges(q, kv, meta, 0.1, return_lse=True, range_size=range_size)
    ref, ref_lse = reference.paged_attention_mla(q, kv, meta, 0.1, return_lse=True)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(lse, ref_lse, atol=1e-6, rtol=1e-6)


@gpu
def test_the_walk_is_chosen_where_it_fills_the_device():
    """walk_pays (the speed, never the bits): batch 64 at context 4096 walks (128 blocks, one wave,
    against 1024 per-range blocks in 8 waves on 132 SMs), and so do its verify rows; batch 1, 8 and
    32 keep a block per range."""
    dev = torch.device("cuda")

    def meta(batch: int, ctx: int, q_len: int = 1) -> AttentionMetadata:
        return step_meta([(ctx, q_len)] * batch, [0] * (ctx // 64), 64, dev)

    full = cuda_mla.num_sms(dev) // 2  # 2 pair tiles of 128 heads per row: one block per SM (64 on an H100)
    assert cuda_mla.walk_pays(meta(full, 8 * U), 128, 8, dev)
    assert cuda_mla.walk_pays(meta(full, 8 * U, 5), 128, 8, dev)  # verify rows: 5 waves of walkers
    assert not cuda_mla.walk_pays(meta(full // 2, 8 * U), 128, 8, dev)  # half the SMs would idle
    assert not cuda_mla.walk_pays(meta(1, 8 * U), 128, 8, dev)
    assert not cuda_mla.walk_pays(meta(8, 8 * U), 128, 8, dev)
    assert not cuda_mla.walk_pays(meta(full, U), 128, 1, dev)  # one range: nothing to walk


@gpu
def test_the_default_mode_walks_one_range_where_walking_fills_the_device(monkeypatch):
    """A full batch in the default mode walks each row as one range (default_walk_unit): the bits
    of the invariant mode's walk with a single range a row, not of the per-row split rule; half
    the batch keeps the rule."""
    dev = torch.device("cuda")
    rows = cuda_mla.num_sms(dev) // 2
    ctx, bs = 8 * U - 40, 64
    gen = torch.Generator(device=dev).manual_seed(5)
    kv = torch.randn(ctx // bs + 4, bs, 576, device=dev, dtype=torch.bfloat16, generator=gen)
    table = torch.randperm(ctx // bs + 4, device=dev, generator=gen)[: -(-ctx // bs)].tolist()
    meta = step_meta([(ctx, 1)] * rows, table, bs, dev)
    q = torch.randn(rows, 128, 576, device=dev, dtype=torch.bfloat16, generator=gen)
    assert cuda_mla.default_walk_unit(meta, 128, 8, dev) == 8 * U
    half = step_meta([(ctx, 1)] * (rows // 2), table, bs, dev)
    assert cuda_mla.default_walk_unit(half, 128, 8, dev) is None
    default = ops.paged_attention_mla(q, kv, meta, 192 ** -0.5, return_lse=True)
    monkeypatch.setattr(cuda_mla, "SPLIT_BLOCK", 8 * U)
    monkeypatch.setattr(cuda_mla, "force_walk", True)
    with use_kernel_config(batch_invariant=True):
        one_range = ops.paged_attention_mla(q, kv, meta, 192 ** -0.5, return_lse=True)
    monkeypatch.setattr(cuda_mla, "SPLIT_BLOCK", U)
    with use_kernel_config(batch_invariant=True):
        ranges = ops.paged_attention_mla(q, kv, meta, 192 ** -0.5, return_lse=True)
    assert torch.equal(default[0], one_range[0]) and torch.equal(default[1], one_range[1])
    assert not torch.equal(default[0], ranges[0])  # 8 ranges merged: other bits
    ref = reference.paged_attention_mla(q.float(), kv.float(), meta, 192 ** -0.5)
    torch.testing.assert_close(default[0].float(), ref, atol=2e-2, rtol=2e-2)


SANITIZER = shutil.which("compute-sanitizer")
TESTS = os.path.dirname(os.path.abspath(__file__))


@gpu
@pytest.mark.skipif(SANITIZER is None, reason="needs compute-sanitizer on PATH")
@pytest.mark.parametrize("walk", [True, False], ids=["walk", "split"])
def test_fixed_ranges_memcheck_clean(walk):
    """compute-sanitizer memcheck over both assignments of the fast tile (the walking blocks' slab
    accesses, L2 hints and discards; more walking blocks than slabs in the second step)."""
    program = f"""
import torch
from pyengine import ops
from pyengine.ops.cuda import mla as cuda_mla
from pyengine.ops.kernel_config import use_kernel_config
from test_mla_fixed_ranges_gpu import Sequence, SEQ, U
cuda_mla.force_walk = {walk}
seq = Sequence(64, 128)
with use_kernel_config(batch_invariant=True):
    for rows in ([(SEQ, 1), (U + 1, 3), (7, 7), (1500, 17), (2 * U, 2)], [(SEQ - 7 * i, 1 + i % 4) for i in range(40)]):
        meta, q, _ = seq.inputs(rows)
        ops.paged_attention_mla(q, seq.kv, meta, 192 ** -0.5, return_lse=True)
torch.cuda.synchronize()
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(TESTS), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([SANITIZER, "--tool", "memcheck", "--print-limit", "5", sys.executable, "-c", program],
                          capture_output=True, text=True, timeout=600, cwd=TESTS, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "ERROR SUMMARY: 0 errors" in out, out[-3000:]
