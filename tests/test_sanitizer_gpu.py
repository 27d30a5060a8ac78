"""The attention kernels and the invariant GEMMs under compute-sanitizer (memcheck: out-of-bounds / misaligned accesses;
synccheck: barrier misuse, e.g. a warp-aligned barrier reached by diverged lanes). Each check runs a
mixed batch (decode, verify, prefill, empty and long rows; unused cache pages NaN) in a child process
under the tool and requires its "ERROR SUMMARY: 0 errors". Skipped without a GPU or the tool.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

try:
    from pyengine.ops import cuda as cuda_ops
except ImportError:  # no GPU kernels in this build
    cuda_ops = None

SANITIZER = shutil.which("compute-sanitizer")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or cuda_ops is None, reason="needs CUDA and the GPU kernels"),
    pytest.mark.skipif(SANITIZER is None, reason="needs compute-sanitizer on PATH"),
]

TESTS = os.path.dirname(os.path.abspath(__file__))
ROWS = "[(1500, 2), (3000, 1), (0, 0), (5, 7), (600, 16), (70, 17), (130, 1)]"
# Each program takes the kernel variant as its argument (sys.argv[1]) and runs under that KernelConfig.
PROGRAMS = {
    "mla": f"""
import sys
import torch
from pyengine.ops.kernel_config import use_kernel_config
from test_kernels_gpu import mla_case
with use_kernel_config(mla_small_tile=sys.argv[1] == "small"):
    mla_case({ROWS}, 64, 128, torch.bfloat16)
    mla_case({ROWS}, 16, 20, torch.float16, seed=1)
torch.cuda.synchronize()
""",
    "gemm": """
import torch
from pyengine.ops import cuda as cuda_ops
g = torch.Generator(device="cuda").manual_seed(0)
from pyengine.ops.cuda.launch import kernels, num_sms, params, stream
def gemm(x, w, bias, split, family):  # family 1: mma.sync; 2: wgmma (TMA) where built
    y = torch.empty(x.shape[0], w.shape[1], dtype=x.dtype, device="cuda")
    p = params(kernels.InvariantGemmParams, x=x.data_ptr(), w=w.data_ptr(), bias=bias.data_ptr(), y=y.data_ptr(),
               m=x.shape[0], n=w.shape[1], k=x.shape[1], x_stride=x.shape[1], y_stride=w.shape[1], dtype=1,
               num_sms=num_sms(x.device), split=split, family=family)
    kernels.invariant_gemm(p, stream(x.device))
# decode tile, cluster combines, row / column tails, and (700 x 2944: more tiles than SMs) the one-block walk
for m, k, n in [(1, 576, 960), (17, 576, 968), (300, 4096, 1032), (5, 1536, 576), (700, 256, 2944)]:
    x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    w = torch.randn(k, n, device="cuda", generator=g).bfloat16()
    for split in (1, 2, 8):
        for family in (1, 2):
            gemm(x, w, torch.ones(n, device="cuda").bfloat16(), split, family)
torch.cuda.synchronize()
""",
    # The fp32 invariant GEMM (row and column tails, any width, every split) and the grouped
    # bf16 one: expert-sorted rows with empty and one-row groups, and heads as groups of a strided view.
    "f32gemm": """
import torch
from pyengine.ops.cuda.gemm import invariant_gemm_f32
g = torch.Generator(device="cuda").manual_seed(0)
for m, k, n in [(1, 576, 960), (17, 100, 37), (300, 4096, 1032), (5, 1536, 576)]:
    x = torch.randn(m, k, device="cuda", generator=g)
    w = torch.randn(k, n, device="cuda", generator=g)
    for split in ((0, 1, 2) if k < 512 else (0, 1, 2, 8)):  # 0: the shape's default split
        invariant_gemm_f32(x, w, torch.ones(n, device="cuda"), split=split)
torch.cuda.synchronize()
""",
    "grouped": """
import torch
from pyengine.ops import cuda as cuda_ops
g = torch.Generator(device="cuda").manual_seed(0)
counts = torch.tensor([0, 1, 37, 0, 5, 130, 1, 0], dtype=torch.int32)
x = torch.randn(int(counts.sum()), 512, device="cuda", generator=g).bfloat16()
w = torch.randn(len(counts), 512, 264, device="cuda", generator=g).bfloat16()
offs = counts.cumsum(0).to(torch.int32).cuda()
for split in (1, 2, 4):
    cuda_ops.grouped_gemm(x, w, offs, split=split)
heads = torch.randn(9, 16, 192, device="cuda", generator=g).bfloat16()[:, :, :128]  # strided [T, H, K]
cuda_ops.grouped_gemm(heads, torch.randn(16, 128, 512, device="cuda", generator=g).bfloat16())
torch.cuda.synchronize()
""",
    # The chunk-wise Gated DeltaNet prefill: rows across chunk boundaries, an empty row, a PAD row.
    "gdnchunk": """
import torch
from test_gdn_gpu import inputs, i32, qsl
from pyengine.ops.cuda import gdn_prefill
for h, hv, dk, dv in [(2, 4, 64, 32), (16, 32, 128, 128)]:
    lengths = [70, 0, 130, 5]
    x = inputs(sum(lengths), h, hv, dk, dv, torch.bfloat16)
    state = torch.randn(8, hv, dv, dk, device="cuda")
    gdn_prefill.chunked_gated_delta_rule_prefill(x["q"], x["k"], x["v"], x["g"], x["beta"], state, qsl(lengths),
                                                 i32([[0, 1], [2, 3], [-1, -1], [6, 7]]),
                                                 torch.tensor([True, False, False, True], device="cuda"))
torch.cuda.synchronize()
""",
    "gqa": f"""
import sys
import torch
from pyengine.ops.kernel_config import use_kernel_config
from test_kernels_gpu import gqa_case
with use_kernel_config(gqa_fma=sys.argv[1] == "fma"):
    gqa_case({ROWS}, 16, 8, 4, torch.bfloat16)
    gqa_case({ROWS}, 1, 2, 8, torch.float16, head_dim=64)
# batch-invariant splits: workspace ranges of decode / verify rows, prefill rows walking several ranges
with use_kernel_config(gqa_fma=sys.argv[1] == "fma", batch_invariant=True):
    gqa_case({ROWS} + [(1400, 40)], 16, 8, 4, torch.bfloat16)
    gqa_case({ROWS} + [(1100, 20)], 1, 2, 8, torch.float16, head_dim=256)
torch.cuda.synchronize()
""",
    # The Gated DeltaNet kernel under both of its grids (ops.cuda.gdn.force_grid; argv: direct, persistent or
    # default for both): verify rows of every length, a PAD row, a row starting from a PAD slot,
    # grouped heads, K below one warp's 128, prefill rows (final state only), and a step of more
    # items than the device holds (blocks walking several items, the next base prefetched).
    "gdn": """
import os, sys
import torch
from test_gdn_gpu import inputs, run_update, i32, qsl
from pyengine.ops import cuda as cuda_ops
from pyengine.ops.cuda import gdn as cuda_gdn
for grid in (["direct", "persistent"] if sys.argv[1] == "default" else [sys.argv[1]]):
    cuda_gdn.force_grid = grid
    for h, hv, dk, dv in [(2, 4, 16, 24), (16, 32, 128, 128), (1, 2, 256, 8)]:
        x = inputs(11, h, hv, dk, dv, torch.bfloat16)
        state = torch.randn(16, hv, dv, dk, device="cuda")
        run_update(cuda_ops.gated_delta_rule_update, x, state, [1, 4, 2, 3, 1], [[0, 1, 2, 3], [4, 5, 6, 7],
                   [-1, -1, -1, -1], [8, 9, 10, 11], [12, -1, 13, 14]], [1, 4, 2, 3, 2])
        cuda_ops.gated_delta_rule_chunked(x["q"], x["k"], x["v"], x["g"], x["beta"], qsl([7, 0, 4]), state,
                                          i32([[0, 1], [2, 3], [4, 5]]), i32([2, 1, 1]),
                                          torch.tensor([True, False, False], device="cuda"))
    rows = 12
    lengths = [1 + n % 5 for n in range(rows)]
    x = inputs(sum(lengths), 16, 32, 128, 128, torch.bfloat16, seed=1)
    state = torch.randn(5 * rows, 32, 128, 128, device="cuda")
    idx = [[5 * n + j for j in range(5)] for n in range(rows)]
    run_update(cuda_ops.gated_delta_rule_update, x, state, lengths, idx, [1] * rows)
    run_update(cuda_ops.gated_delta_rule_update, x, state, lengths, idx, [1 + n % 5 for n in range(rows)])
torch.cuda.synchronize()
""",
    # DeepSeek-V3 with MTP speculation end to end: every kernel of the model (MLA, latent cache
    # writes, layer ops, skinny GEMM) over prefill, decode and verify steps and the MTP layer's forwards.
    "deepseek": """
import os, sys, tempfile
sys.path.insert(0, os.path.dirname(os.getcwd()))
from tests.tiny_models import make_deepseek_checkpoint, make_prompts
from tests.test_deepseek_v3_gpu import REAL_MLA
from pyengine import LLM, SamplingParams
path = tempfile.mkdtemp()
make_deepseek_checkpoint(path, mtp_agreement=0.01, layer_scale=0.003, **REAL_MLA)
llm = LLM(path, device="cuda", dtype="bfloat16", block_size=16, max_num_batched_tokens=32, num_kv_blocks=64,
          speculative_config={"method": "mtp", "num_speculative_tokens": 3, "adaptive_draft_length": False})
llm.generate(make_prompts(4, seed=3), SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
assert llm.stats()["num_accepted_tokens"] > 0
""",
    # Prefix caching of a hybrid model: checkpoint saves and restores of the recurrent state (torch
    # index copies over every Mamba layer's pools) between CUDA-graph replays, block size 4, verify
    # rows crossing checkpoint positions.
    "hybrid": """
import os, sys, tempfile
sys.path.insert(0, os.path.dirname(os.getcwd()))
from tests.test_bamba import make_bamba_checkpoint
from tests.test_hybrid_prefix_cache import NGRAM, run_phases, two_phase_prompts
path = tempfile.mkdtemp()
make_bamba_checkpoint(path)
gpu = dict(device="cuda", dtype="float32")
phase1, phase2, _ = two_phase_prompts(path, 4, seed=3, **gpu)
out = run_phases(path, [phase1, phase2], [12, 4], True, 4, NGRAM, **gpu)
assert out[2]["num_state_restores"] > 0 and out[2]["num_state_checkpoints_saved"] > 0
""",
}


def run_under(tool: str, program: str, variant: str) -> str:
    proc = subprocess.run(
        [SANITIZER, "--tool", tool, "--print-limit", "5", sys.executable, "-c", program, variant],
        capture_output=True, text=True, timeout=600, cwd=TESTS,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    return out


@pytest.mark.parametrize("kernel", ["mla", "gqa", "gqa_fma", "gemm", "f32gemm", "grouped", "gdn", "gdnchunk",
                                    "deepseek", "hybrid"])
def test_memcheck_clean(kernel):
    """gqa: the tensor-core kernel NVIDIA runs; gqa_fma: the FMA kernel (AMD's), forced; gemm: the
    batch-invariant GEMM's two families, wgmma fed by TMA and mma.sync (row and column tails, every
    split, the decode tile, the cluster combine and the one-block walk); f32gemm and grouped: its fp32 and
    grouped forms; gdn: the Gated DeltaNet update and prefill; gdnchunk: the chunk-wise prefill; deepseek: a DeepSeek-V3 model's
    kernels under MTP speculation; hybrid: a Bamba model's kernels and state checkpoint copies
    under prefix caching and ngram speculation."""
    family, _, variant = kernel.partition("_")
    out = run_under("memcheck", PROGRAMS[family], variant or "default")
    assert "ERROR SUMMARY: 0 errors" in out, out[-3000:]


@pytest.mark.parametrize("tool", ["racecheck", "synccheck"])
def test_gqa_mma_shared_memory_clean(tool):
    """The tensor-core GQA kernel runs one cp.async pipeline per warp with warp-level syncs only, then
    reuses all warps' stages as the block's merge buffer: a missing barrier shows as a hazard here."""
    out = run_under(tool, PROGRAMS["gqa"], "mma")
    clean = "RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)" if tool == "racecheck" else "ERROR SUMMARY: 0 errors"
    assert clean in out, out[-3000:]


@pytest.mark.parametrize("tool", ["racecheck", "synccheck"])
def test_invariant_gemm_shared_memory_clean(tool):
    """The invariant GEMMs' pipelines (cp.async stages; TMA stages on full / empty mbarriers) and
    their reuse of the stages as the cluster's exchange buffer (the split-K combine)."""
    out = run_under(tool, PROGRAMS["gemm"], "default")
    clean = "RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)" if tool == "racecheck" else "ERROR SUMMARY: 0 errors"
    assert clean in out, out[-3000:]


@pytest.mark.parametrize("tool", ["racecheck", "synccheck"])
def test_gdn_shared_memory_clean(tool):
    """The Gated DeltaNet kernel under both grids: staged tokens and records read by every warp between
    barriers, outputs and records written from shared memory after them, and on the persistent grid
    the next item's base copied (cp.async) into the one buffer each thread reads back its own chunks of."""
    out = run_under(tool, PROGRAMS["gdn"], "default")
    clean = "RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)" if tool == "racecheck" else "ERROR SUMMARY: 0 errors"
    assert clean in out, out[-3000:]


@pytest.mark.parametrize("tile", ["fast", "small"])
def test_mla_synccheck_clean(tile):
    """The fast tile's warpgroups hand tiles over through named barriers after per-lane branches:
    with the warp-aligned bar.sync this reported 128 divergent-barrier errors."""
    out = run_under("synccheck", PROGRAMS["mla"], tile)
    assert "ERROR SUMMARY: 0 errors" in out, out[-3000:]
