"""Verify-step cost against a decode step, end to end, on a Llama-3-8B-shaped model (random bf16
weights) on the GPU: one forward of the whole model over b rows of q = 1 + k tokens each at a given
context, plus the logits of every token (a verify step samples them all), timed as a CUDA graph.
Speculation pays only if a verify step costs much less than the (1 + accepted) decode steps it
replaces. Both GQA attention kernels run in the same process (KernelConfig.gqa_fma selects the FMA
kernel; the graph captures the kernel chosen while it is captured).

    python benchmarks/bench_verify.py [--batches 1 16 64] [--context 4096] [--q-lens 1 2 3 5 9]
"""
from __future__ import annotations

import argparse

import torch

from bench_decode import LLAMA8B_HF, random_llama  # noqa: E402  (benchmarks/ is on sys.path)
from gpu_timing import copy_bandwidth_gbps, run_header, time_ms_graph, write_result
from pyengine.engine.attention_metadata import AttentionMetadata
from pyengine.ops.kernel_config import use_kernel_config

BLOCK = 16


def step_inputs(batch: int, context: int, q_len: int, blocks_per_row: int, vocab: int):
    """Rows of q_len new tokens at positions context - q_len .. context - 1, row r owning blocks
    r * blocks_per_row ...; the new tokens' K/V slots are their own positions."""
    gen = torch.Generator().manual_seed(q_len)
    tables = torch.arange(batch * blocks_per_row, dtype=torch.int32).view(batch, blocks_per_row)
    pos = torch.arange(context - q_len, context).repeat(batch)
    rows = torch.arange(batch).repeat_interleave(q_len)
    slots = tables[rows, pos // BLOCK].long() * BLOCK + pos % BLOCK
    meta = AttentionMetadata(
        slot_mapping=slots.cuda(), block_tables=tables.cuda(),
        query_start_loc=torch.arange(0, batch * q_len + 1, q_len, dtype=torch.int32).cuda(),
        context_lens=torch.full((batch,), context, dtype=torch.int32).cuda(),
        max_query_len=q_len, max_context_len=context, block_size=BLOCK)
    ids = torch.randint(10, vocab, (batch * q_len,), generator=gen).cuda()
    return ids, pos.cuda(), meta


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--q-lens", type=int, nargs="+", default=[1, 2, 3, 5, 9])
    ap.add_argument("--out", default="benchmarks/results/verify_8b_h100.json")
    args = ap.parse_args()
    if 1 not in args.q_lens:
        raise SystemExit("--q-lens must include 1 (the decode step every cost is relative to)")

    copy_bw = copy_bandwidth_gbps()
    model, cfg = random_llama(LLAMA8B_HF)
    blocks_per_row = (args.context + BLOCK - 1) // BLOCK
    shape = (max(args.batches) * blocks_per_row, BLOCK, cfg.num_key_value_heads, cfg.head_dim)
    gen = torch.Generator(device="cuda").manual_seed(1)
    kv = [(torch.empty(shape, dtype=torch.bfloat16, device="cuda").normal_(0, 1, generator=gen),
           torch.empty(shape, dtype=torch.bfloat16, device="cuda").normal_(0, 1, generator=gen))
          for _ in range(cfg.num_hidden_layers)]
    results = []
    for batch in args.batches:
        for kernel in ("mma", "fma"):
            decode_ms = None
            for q_len in sorted(args.q_lens):
                ids, pos, meta = step_inputs(batch, args.context, q_len, blocks_per_row, cfg.vocab_size)

                @torch.inference_mode()
                def step():
                    return model.compute_logits(model(ids, pos, meta, kv))

                with use_kernel_config(gqa_fma=kernel == "fma"):
                    ms = time_ms_graph(step, inner=3, reps=7)
                decode_ms = ms if q_len == 1 else decode_ms
                row = dict(batch=batch, context=args.context, q_len=q_len, attention_kernel=kernel, step_ms=ms,
                           relative_to_decode=ms / decode_ms)
                results.append(row)
                print(f"b={batch:3d} ctx={args.context} q={q_len} {kernel}: {ms:.3f} ms "
                      f"({ms / decode_ms:.2f}x decode)", flush=True)
    write_result(args.out, dict(run_header(), copy_bandwidth_GBps=copy_bw, model="Llama-3-8B shape, random bf16 weights",
                                block_size=BLOCK, results=results))


if __name__ == "__main__":
    main()
