"""The attention kernels under compute-sanitizer (memcheck: out-of-bounds / misaligned accesses;
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
PROGRAMS = {
    "mla": f"""
import torch
from test_kernels_gpu import mla_case
mla_case({ROWS}, 64, 128, torch.bfloat16)
mla_case({ROWS}, 16, 20, torch.float16, seed=1)
torch.cuda.synchronize()
""",
    "gqa": f"""
import torch
from test_kernels_gpu import gqa_case
gqa_case({ROWS}, 16, 8, 4, torch.bfloat16)
gqa_case({ROWS}, 1, 2, 8, torch.float16, head_dim=64)
torch.cuda.synchronize()
""",
}


def run_under(tool: str, program: str, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run(
        [SANITIZER, "--tool", tool, "--print-limit", "5", sys.executable, "-c", program],
        capture_output=True, text=True, timeout=600, cwd=TESTS, env={**os.environ, **(env or {})},
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    return out


@pytest.mark.parametrize("kernel", ["mla", "gqa", "gqa_fma"])
def test_memcheck_clean(kernel):
    """gqa: the tensor-core kernel NVIDIA runs; gqa_fma: the FMA kernel (AMD's), forced."""
    env = {"PYENGINE_GQA_FMA": "1" if kernel == "gqa_fma" else "0"}
    out = run_under("memcheck", PROGRAMS[kernel.split("_")[0]], env)
    assert "ERROR SUMMARY: 0 errors" in out, out[-3000:]


@pytest.mark.parametrize("tool", ["racecheck", "synccheck"])
def test_gqa_mma_shared_memory_clean(tool):
    """The tensor-core GQA kernel runs one cp.async pipeline per warp with warp-level syncs only, then
    reuses all warps' stages as the block's merge buffer: a missing barrier shows as a hazard here."""
    out = run_under(tool, PROGRAMS["gqa"], {"PYENGINE_GQA_FMA": "0"})
    clean = "RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)" if tool == "racecheck" else "ERROR SUMMARY: 0 errors"
    assert clean in out, out[-3000:]


@pytest.mark.parametrize("tile", ["fast", "small"])
def test_mla_synccheck_clean(tile):
    """The fast tile's warpgroups hand tiles over through named barriers after per-lane branches:
    with the warp-aligned bar.sync this reported 128 divergent-barrier errors."""
    env = {"PYENGINE_MLA_SMALL_TILE": "1" if tile == "small" else "0"}
    out = run_under("synccheck", PROGRAMS["mla"], env)
    assert "ERROR SUMMARY: 0 errors" in out, out[-3000:]
