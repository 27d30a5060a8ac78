"""Nsight Compute view of the invariant GEMM against cuBLAS at decode sizes (issue 18: SmolLM2's
decode steps at batch 16 / 64 lose ~0.1 ms to the invariant GEMMs). Two parts:

  run:  each (shape, M) of --cases through the invariant GEMM (the default family and tile) and
        cuBLAS (torch.mm), twice each (the first warms up), for ncu to capture;
  top:  from `ncu -i REPORT --page source --csv --print-source sass` output (stdin): the SASS
        instructions with the most warp-stall samples, and the total per stall reason.

    ncu --set full -k regex:'invariant_gemm_kernel|nvjet|wgmma' -o OUT/gemm python3 benchmarks/profile_gemm_ncu.py run
    ncu -i OUT/gemm.ncu-rep --page source --csv --print-source sass --launch-skip 1 --launch-count 1 \\
        | python3 benchmarks/profile_gemm_ncu.py top
"""
from __future__ import annotations

import argparse
import csv
import os
import sys

SMOLLM2 = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576)}


def run(cases: list[tuple[str, int]]) -> None:
    import torch

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from pyengine.ops import cuda as cuda_ops

    for name, m in cases:
        k, n = SMOLLM2[name]
        w = (torch.randn(k, n, device="cuda") / k ** 0.5).bfloat16()
        x = torch.randn(m, k, device="cuda").bfloat16()
        for _ in range(2):
            cuda_ops.invariant_gemm(x, w)
        for _ in range(2):
            torch.mm(x, w)
        torch.cuda.synchronize()


def top(rows: int) -> None:
    lines = [line for line in sys.stdin if line.strip()]
    start = next((i for i, line in enumerate(lines) if line.startswith('"') and "Source" in line), None)
    if start is None:
        print("no source table in the input:", "".join(lines[:20]))
        return
    table = list(csv.DictReader(lines[start:]))
    if not table:
        return
    cols = list(table[0])
    samples = next((c for c in cols if c.startswith("Warp Stall Sampling (All")), None)
    if samples is None:
        print("columns:", cols)
        return

    def num(v: str) -> float:
        try:
            return float(v.replace(",", ""))
        except ValueError:
            return 0.0
    total = sum(num(r[samples]) for r in table) or 1.0
    print(f"{len(table)} SASS instructions, {total:.0f} stall samples")
    for r in sorted(table, key=lambda r: -num(r[samples]))[:rows]:
        print(f"  {100 * num(r[samples]) / total:5.1f}%  {r.get('Address', ''):>6}  {r['Source'][:110]}")
    reasons = [c for c in cols if c.startswith("stall_") or "Stall" in c and c != samples and "Sampling" not in c]
    sums = {c: sum(num(r[c]) for r in table) for c in reasons}
    print("  by column: " + ", ".join(f"{c} {v:.0f}" for c, v in sorted(sums.items(), key=lambda kv: -kv[1])[:12] if v))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["run", "top"])
    ap.add_argument("--cases", default="qkv:16,gate_up:64", help="shape:M pairs")
    ap.add_argument("--rows", type=int, default=25)
    args = ap.parse_args()
    if args.what == "run":
        run([(c.split(":")[0], int(c.split(":")[1])) for c in args.cases.split(",")])
    else:
        top(args.rows)


if __name__ == "__main__":
    main()
