"""Decode attention bandwidth of the paged-attention kernels against the device's copy bandwidth.

Bandwidth = bytes of K/V the step must read (each row's context once) / kernel time, compared with a
device-to-device copy measured in the same run (bytes read + written / time). Kernel time is taken
inside a CUDA graph of 20 back-to-back calls (gpu_timing.time_ms_graph), as a captured decode step
runs them; `eager_call_ms` also times one Python call between CUDA events (launch overhead
included). The split-KV unit (ops.cuda.attention.SPLIT_BLOCK) is swept at batch 64 to pick the default, and
for MLA at batch 1, 8 and 64. Shapes: Llama-3-8B
(32 query heads, 8 KV heads, D 128, block 16) and DeepSeek-V3 MLA (128 heads, 576/512, block 64),
bf16. Also the cost of a verify step (q = 1 + k per row) relative to decode, and (`gqa_kernels`) the
tensor-core GQA kernel against the FMA one on decode, verify and prefill-chunk steps.

    python benchmarks/bench_attention.py --out benchmarks/results/attention_h100.json
"""
from __future__ import annotations

import argparse

import torch

from pyengine.engine.attention_metadata import AttentionMetadata
from pyengine.ops import cuda as cuda_ops
from pyengine.ops.cuda import attention as cuda_attention
from pyengine.ops.kernel_config import use_kernel_config
from gpu_timing import copy_bandwidth_gbps, time_ms, time_ms_graph, write_result, run_header  # noqa: E402  (benchmarks/ is on sys.path)


def make_meta(batch: int, ctx: int, q_len: int, block_size: int, num_blocks: int, gen) -> AttentionMetadata:
    per_row = (ctx + block_size - 1) // block_size
    perm = torch.randperm(num_blocks, generator=gen)[: batch * per_row]
    tables = perm.view(batch, per_row).to(torch.int32).cuda()
    return AttentionMetadata(
        slot_mapping=torch.zeros(batch * q_len, dtype=torch.int64, device="cuda"),
        block_tables=tables,
        query_start_loc=torch.arange(0, batch * q_len + 1, q_len, dtype=torch.int32, device="cuda"),
        context_lens=torch.full((batch,), ctx, dtype=torch.int32, device="cuda"),
        max_query_len=q_len,
        max_context_len=ctx,
        block_size=block_size,
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/attention_h100.json")
    ap.add_argument("--batches", default="1,8,32,64,128,256")
    ap.add_argument("--contexts", default="512,1024,4096,8192,32768")
    ap.add_argument("--max-tokens", type=int, default=4 << 20, help="skip points with batch*ctx above this")
    ap.add_argument("--mla-only", action="store_true", help="skip the GQA part (MLA kernel work)")
    args = ap.parse_args()
    batches = [int(x) for x in args.batches.split(",")]
    contexts = [int(x) for x in args.contexts.split(",")]
    gen = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16
    copy_bw = copy_bandwidth_gbps()
    print(f"device-to-device copy: {copy_bw:.0f} GB/s", flush=True)
    result = {
        **run_header(),
        "copy_bandwidth_GBps": copy_bw,
        "gqa": [], "mla": [], "verify": [],
    }

    max_tok = min(args.max_tokens, max(batches) * max(contexts))
    if not args.mla_only:
        gqa(result, batches, contexts, max_tok, copy_bw, gen, dtype)
    mla(result, batches, contexts, max_tok, copy_bw, gen, dtype)
    write_result(args.out, result)
    print(f"decode_bandwidth_fraction (gqa b=64 ctx=4096): {result.get('decode_bandwidth_fraction')}; "
          f"mla: {result.get('mla_decode_bandwidth_fraction')}")


def gqa(result: dict, batches: list[int], contexts: list[int], max_tok: int, copy_bw: float, gen, dtype) -> None:
    # Llama-3-8B decode.
    hq, hkv, d, bs = 32, 8, 128, 16
    nblocks = max_tok // bs + 1
    k = torch.randn(nblocks, bs, hkv, d, device="cuda", dtype=dtype)
    v = torch.randn_like(k)
    decode_ms = {}
    for batch in batches:
        for ctx in contexts:
            if batch * ctx > max_tok:
                continue
            meta = make_meta(batch, ctx, 1, bs, nblocks, gen)
            q = torch.randn(batch, hq, d, device="cuda", dtype=dtype)
            call = lambda: cuda_ops.paged_attention(q, k, v, meta, d ** -0.5)  # noqa: E731
            ms = time_ms_graph(call)
            nbytes = batch * ctx * hkv * d * 2 * k.element_size()
            bw = nbytes / ms / 1e6
            decode_ms[(batch, ctx)] = ms
            result["gqa"].append({"batch": batch, "context": ctx, "ms": ms, "GBps": bw, "fraction_of_copy": bw / copy_bw,
                                  "eager_call_ms": time_ms(call)})
            print(f"gqa  b={batch:4d} ctx={ctx:6d} {ms:8.3f} ms {bw:7.0f} GB/s {bw / copy_bw:5.2f}", flush=True)
    # Verify steps relative to decode at batch 64, ctx 4096.
    for k_spec in (1, 2, 3, 4, 7):
        batch, ctx, q_len = 64, 4096, 1 + k_spec
        if batch * ctx > max_tok or (batch, ctx) not in decode_ms:
            continue
        meta = make_meta(batch, ctx, q_len, bs, nblocks, gen)
        q = torch.randn(batch * q_len, hq, d, device="cuda", dtype=dtype)
        ms = time_ms_graph(lambda: cuda_ops.paged_attention(q, k, v, meta, d ** -0.5))
        rel = ms / decode_ms[(batch, ctx)]
        result["verify"].append({"batch": batch, "context": ctx, "q_len": q_len, "ms": ms, "relative_to_decode": rel})
        print(f"verify q={q_len} b={batch} ctx={ctx} {ms:8.3f} ms  x{rel:.2f} of decode", flush=True)
    # Split-KV unit sweep (a per-process setting; a row's result never depends on the batch).
    default_split = cuda_attention.SPLIT_BLOCK
    result["split_sweep"] = []
    for split in (256, 512, 1024, 2048):
        cuda_attention.SPLIT_BLOCK = split
        for ctx in (4096, 32768):
            batch = 64 if ctx == 4096 else 8
            if batch * ctx > max_tok:
                continue
            meta = make_meta(batch, ctx, 1, bs, nblocks, gen)
            q = torch.randn(batch, hq, d, device="cuda", dtype=dtype)
            ms = time_ms_graph(lambda: cuda_ops.paged_attention(q, k, v, meta, d ** -0.5))
            bw = batch * ctx * hkv * d * 2 * k.element_size() / ms / 1e6
            result["split_sweep"].append({"split_block": split, "batch": batch, "context": ctx, "ms": ms,
                                          "fraction_of_copy": bw / copy_bw})
            print(f"split {split:5d} b={batch} ctx={ctx} {ms:8.3f} ms {bw / copy_bw:5.2f}", flush=True)
    cuda_attention.SPLIT_BLOCK = default_split
    result["split_block"] = default_split
    # The two GQA kernels side by side: decode, verify and prefill chunks (batch, context, q_len).
    # "mma" (tensor cores) is what NVIDIA runs; "fma" (CUDA cores) is AMD's, forced here.
    result["gqa_kernels"] = []
    for batch, ctx, q_len in ((64, 4096, 1), (64, 4096, 5), (1, 4096, 512), (4, 2048, 512), (1, 8192, 2048)):
        if batch * ctx > max_tok:
            continue
        meta = make_meta(batch, ctx, q_len, bs, nblocks, gen)
        q = torch.randn(batch * q_len, hq, d, device="cuda", dtype=dtype)
        for kernel in ("mma", "fma"):
            with use_kernel_config(gqa_fma=kernel == "fma"):
                ms = time_ms_graph(lambda: cuda_ops.paged_attention(q, k, v, meta, d ** -0.5), inner=5)
            result["gqa_kernels"].append({"kernel": kernel, "batch": batch, "context": ctx, "q_len": q_len, "ms": ms})
            print(f"gqa {kernel} b={batch} ctx={ctx} q={q_len} {ms:8.3f} ms", flush=True)
    frac = [r["fraction_of_copy"] for r in result["gqa"] if r["batch"] == 64 and r["context"] == 4096]
    result["decode_bandwidth_fraction"] = frac[0] if frac else None
    del k, v
    torch.cuda.empty_cache()


def mla(result: dict, batches: list[int], contexts: list[int], max_tok: int, copy_bw: float, gen, dtype) -> None:
    # DeepSeek-V3 MLA decode.
    hq, bs = 128, 64
    max_tok_mla = min(max_tok, 2 << 20)
    nblocks = max_tok_mla // bs + 1
    kv = torch.randn(nblocks, bs, 576, device="cuda", dtype=dtype)

    def time_mla(batch: int, ctx: int, q_len: int = 1) -> float:
        meta = make_meta(batch, ctx, q_len, bs, nblocks, gen)
        q = torch.randn(batch * q_len, hq, 576, device="cuda", dtype=dtype)
        return time_ms_graph(lambda: cuda_ops.paged_attention_mla(q, kv, meta, 192 ** -0.5), inner=3, reps=5)

    def gbps(batch: int, ctx: int, ms: float) -> float:  # latent cache bytes read (each row's context once)
        return batch * ctx * 576 * kv.element_size() / ms / 1e6

    for batch in batches:
        for ctx in contexts:
            if batch * ctx > max_tok_mla:
                continue
            ms = time_mla(batch, ctx)
            bw = gbps(batch, ctx, ms)
            result["mla"].append({"batch": batch, "context": ctx, "ms": ms, "GBps": bw, "fraction_of_copy": bw / copy_bw})
            print(f"mla  b={batch:4d} ctx={ctx:6d} {ms:8.3f} ms {bw:7.0f} GB/s {bw / copy_bw:5.2f}", flush=True)
    frac = [r["fraction_of_copy"] for r in result["mla"] if r["batch"] == 64 and r["context"] == 4096]
    result["mla_decode_bandwidth_fraction"] = frac[0] if frac else None
    decode = {(r["batch"], r["context"]): r["ms"] for r in result["mla"]}
    result["mla_verify"] = []
    for q_len in (2, 3, 5):  # verify steps: MLA puts q_len x 128 query heads on each key tile
        if (64, 4096) not in decode:
            break
        ms = time_mla(64, 4096, q_len)
        result["mla_verify"].append({"batch": 64, "context": 4096, "q_len": q_len, "ms": ms,
                                     "relative_to_decode": ms / decode[(64, 4096)]})
        print(f"mla verify q={q_len} b=64 ctx=4096 {ms:8.3f} ms  x{ms / decode[(64, 4096)]:.2f} of decode", flush=True)
    # The split unit trades batch-1 latency (more blocks per row) against the fp32 partials' round
    # trip and the per-block start (fewer, longer blocks) at large batch; the default stays 512.
    default_split = cuda_attention.SPLIT_BLOCK
    result["mla_split_sweep"] = []
    for split in (512, 1024, 2048, 4096):
        cuda_attention.SPLIT_BLOCK = split
        for batch in (1, 8, 64):
            for ctx in (4096, 16384):
                if batch * ctx > max_tok_mla:
                    continue
                ms = time_mla(batch, ctx)
                frac = gbps(batch, ctx, ms) / copy_bw
                result["mla_split_sweep"].append({"split_block": split, "batch": batch, "context": ctx, "ms": ms,
                                                  "fraction_of_copy": frac})
                print(f"mla split {split:5d} b={batch:3d} ctx={ctx:6d} {ms:8.3f} ms {frac:5.2f}", flush=True)
    cuda_attention.SPLIT_BLOCK = default_split


if __name__ == "__main__":
    main()
