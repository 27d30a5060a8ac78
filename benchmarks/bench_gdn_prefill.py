"""Gated DeltaNet prefill on the GPU at Qwen3-Next's widths (16 key heads, 32 value heads,
K = V = 128, bf16 q / k / v, fp32 state): the chunk-wise kernel (hipkernels/ssm/gdn_chunked_prefill.hip)
against the token-by-token recurrence kernel that pyengine.ops.gated_delta_rule_chunked runs today,
for prompt lengths 512 / 2048 / 8192 at batch 1 and 4. Reports ms per call (CUDA events), tokens/s,
the speed-up, the chunked kernel's fp32 throughput (the FLOPs its blocks execute, A and M recomputed
per value tile included) and the largest difference between the two outputs.

    python3 benchmarks/bench_gdn_prefill.py --out benchmarks/results/gdn_prefill_h100.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.gpu_timing import run_header, time_ms, write_result  # noqa: E402
from pyengine import ops  # noqa: E402
from pyengine.ops.cuda import gdn_prefill  # noqa: E402

H, HV, DK, DV = 16, 32, 128, 128
TILE_V = 32  # value columns per block (gdn_chunked_prefill.hip)


def chunked_flops(lengths: list[int], chunk: int) -> float:
    """FLOPs (2 per multiply-add) the chunked kernel's blocks execute."""
    # each thread's Gram micro-tile (gram x gram entries) skips the gram (gram - 1) / 2 above the diagonal
    gram = chunk // 16
    per_chunk = (2 * chunk * chunk * DK * (gram + 1) // (2 * gram)  # Gram matrices k.k and q.k
                 + 2 * chunk * DK * TILE_V         # S0^T k and S0^T q
                 + chunk * chunk * TILE_V // 2     # forward substitution
                 + chunk * chunk * TILE_V          # M U
                 + chunk * DK * TILE_V)            # state update
    blocks = HV * (DV // TILE_V)
    return 2.0 * blocks * per_chunk * sum((n + chunk - 1) // chunk for n in lengths)


def case(batch: int, length: int, reps: int) -> dict:
    lengths = [length] * batch
    ntok = batch * length
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(ntok, H, DK, device="cuda", generator=gen).bfloat16()
    k = torch.randn(ntok, H, DK, device="cuda", generator=gen).bfloat16()
    v = torch.randn(ntok, HV, DV, device="cuda", generator=gen).bfloat16()
    g = -torch.nn.functional.softplus(torch.randn(ntok, HV, device="cuda", generator=gen)) * 0.5
    beta = torch.sigmoid(torch.randn(ntok, HV, device="cuda", generator=gen))
    base = torch.randn(batch, HV, DV, DK, device="cuda", generator=gen) * 0.3
    qsl = torch.arange(0, ntok + 1, length, dtype=torch.int32, device="cuda")
    idx = torch.arange(batch, dtype=torch.int32, device="cuda")[:, None]
    init = torch.ones(batch, dtype=torch.bool, device="cuda")
    acc = torch.ones(batch, dtype=torch.int32, device="cuda")
    s_chunked, s_recurrent = base.clone(), base.clone()

    def chunked() -> torch.Tensor:
        return gdn_prefill.chunked_gated_delta_rule_prefill(q, k, v, g, beta, s_chunked, qsl, idx, init)

    def recurrent() -> torch.Tensor:  # the facade's prefill op as it stands (the recurrence kernel)
        return ops.gated_delta_rule_chunked(q, k, v, g, beta, qsl, s_recurrent, idx, acc, init)

    # one call each from the same state: how far apart the two paths are
    diff = (chunked().float() - recurrent().float()).abs().max().item()
    state_diff = (s_chunked - s_recurrent).abs().max().item()
    ms_c = time_ms(chunked, reps=reps, warmup=2)
    ms_r = time_ms(recurrent, reps=reps, warmup=2)
    flops = chunked_flops(lengths, gdn_prefill.chunk_size())
    return {"batch": batch, "length": length, "chunked_ms": round(ms_c, 3), "recurrent_ms": round(ms_r, 3),
            "speedup": round(ms_r / ms_c, 2), "chunked_tok_per_s": round(ntok / ms_c * 1e3),
            "recurrent_tok_per_s": round(ntok / ms_r * 1e3), "chunked_fp32_tflops": round(flops / ms_c / 1e9, 2),
            "max_out_diff": diff, "max_state_diff_after_one_call": state_diff}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="512,2048,8192")
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    result = dict(run_header(), shape=dict(key_heads=H, value_heads=HV, key_dim=DK, value_dim=DV, dtype="bf16"),
                  chunk=gdn_prefill.chunk_size(), value_tile=TILE_V, rows=[])
    for batch in [int(b) for b in args.batches.split(",")]:
        for length in [int(n) for n in args.lengths.split(",")]:
            row = case(batch, length, args.reps)
            print(json.dumps(row), flush=True)
            result["rows"].append(row)
    if args.out:
        write_result(args.out, result)


if __name__ == "__main__":
    main()
