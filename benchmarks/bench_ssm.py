"""Bandwidth of the recurrent-state kernels (hipkernels/ssm/ssm_state.hip) against the device's copy
bandwidth measured in the same run, side by side with the same computation in PyTorch eager.

Shapes: Mamba2-2.7B-like (80 heads x 64 head dim x 128 state, 1 group; conv dim 5120, W = 4), bf16
activations, fp32 SSM state; batch 1..256; k = 0 (T = 1) and k = 3 (T = 4, verify). Bytes counted
= what the step must move: the read slot plus T written slots of state (SSM: fp32 H*P*N each;
conv: W - 1 rows read, W - 2 + T written) plus inputs, outputs and the conv weights and bias (read
once per call; SSM: A, D, dt_bias). Kernel time is taken inside a
CUDA graph of 20 back-to-back calls (gpu_timing.time_ms_graph), as a captured decode step runs
them; `*_kernel_eager_call_ms` times one Python call between CUDA events (launch overhead included).
The graph replays the same buffers, so a conv step's few MB stay in L2; `conv_kernel_cold_*` cycles
the calls through copies of the data so that each reads HBM (see conv_cold_ms). The conv update is
launched with programmatic dependent launch (PDL, the default on CUDA): in the graph of back-to-back
calls each call's launch overlaps the previous call's end, which a model step (whose kernel before
the conv update is a PyTorch copy, not a PDL-aware kernel) only partly gets; `conv_kernel_nopdl_*`
is the same kernel launched plainly. `copy_kernel_same_size_*` is a plain copy kernel (PyTorch's
elementwise kernel, 16-byte accesses, no PDL) moving the conv update's bytes (half read, half
written), hot and cycling through >= 150 MB like the cold conv timing: what any kernel moving those
bytes reaches at that size.

    python benchmarks/bench_ssm.py --out benchmarks/results/ssm_h100.json
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch
import torch.nn.functional as F

from pyengine.ops import cuda as cuda_ops
from gpu_timing import copy_bandwidth_gbps, time_ms, time_ms_graph, run_header  # noqa: E402  (benchmarks/ is on sys.path)

H, P, N, G = 80, 64, 128, 1
CONV_DIM, W = 5120, 4


def rows(batch: int, k: int):
    T = 1 + k
    idx = torch.arange(batch * T, dtype=torch.int32, device="cuda").view(batch, T)
    acc = torch.randint(1, T + 1, (batch,), dtype=torch.int32, device="cuda")
    qsl = torch.arange(0, batch * T + 1, T, dtype=torch.int32, device="cuda")
    return idx, acc, qsl, T


def eager_ssu(state, x, dt, A, B, C, D, dt_bias, idx, acc, T):
    """Vectorised PyTorch eager of selective_state_update (every row T tokens)."""
    R = idx.shape[0]
    s = state[idx.gather(1, (acc.long() - 1)[:, None])[:, 0].long()]
    x, dt, B, C = x.view(R, T, H, P).float(), dt.view(R, T, H).float(), B.view(R, T, G, N).float(), C.view(R, T, G, N).float()
    ys = []
    for t in range(T):
        d = F.softplus(dt[:, t] + dt_bias)
        bh, ch = B[:, t].repeat_interleave(H // G, 1), C[:, t].repeat_interleave(H // G, 1)
        s = s * torch.exp(A * d)[..., None, None] + (d[..., None] * bh)[:, :, None, :] * x[:, t, ..., None]
        state[idx[:, t].long()] = s
        ys.append((s * ch[:, :, None, :]).sum(-1) + D[:, None] * x[:, t])
    return torch.stack(ys, 1)


def eager_conv(x, conv_state, w, b, idx, acc, T):
    R = idx.shape[0]
    lines = idx[:, 0].long()
    off = (acc.long() - 1)
    rows_ = off[:, None] + torch.arange(W - 1, device="cuda")[None]
    hist = conv_state[lines[:, None], rows_]  # [R, W-1, dim]
    seq = torch.cat([hist, x.view(R, T, -1)], 1).float()
    y = F.silu((seq.unfold(1, W, 1) * w.float()).sum(-1) + b.float())
    conv_state[lines, :W - 2 + T] = seq[:, 1:].to(conv_state.dtype)
    return y


def bench(batch: int, k: int, copy_gbps: float) -> dict:
    idx, acc, qsl, T = rows(batch, k)
    ntok, slots = batch * T, batch * T
    bf = torch.bfloat16
    state = torch.randn(slots, H, P, N, device="cuda")
    x, z = torch.randn(ntok, H, P, device="cuda", dtype=bf), None
    dt = torch.randn(ntok, H, device="cuda", dtype=bf)
    B, C = (torch.randn(ntok, G, N, device="cuda", dtype=bf) for _ in range(2))
    A, D, bias = -torch.rand(H, device="cuda"), torch.randn(H, device="cuda"), torch.randn(H, device="cuda")
    ssu_bytes = batch * (1 + T) * H * P * N * 4 + ntok * (2 * H * P + H + 2 * G * N) * 2 + 3 * H * 4
    ssu_call = lambda: cuda_ops.selective_state_update(state, x, dt, A, B, C, D, z, bias, qsl, idx, acc)  # noqa: E731
    k_ms, k_call_ms = time_ms_graph(ssu_call), time_ms(ssu_call)
    e_ms = time_ms(lambda: eager_ssu(state, x, dt, A, B, C, D, bias, idx, acc, T), reps=5)
    conv_state = torch.randn(slots, W - 1 + k, CONV_DIM, device="cuda", dtype=bf)
    xc = torch.randn(ntok, CONV_DIM, device="cuda", dtype=bf)
    w, b = torch.randn(CONV_DIM, W, device="cuda", dtype=bf), torch.randn(CONV_DIM, device="cuda", dtype=bf)
    # state: W - 1 rows read, W - 2 + T rows written; x read and y written; weights and bias read
    conv_bytes = batch * CONV_DIM * ((W - 1) + (W - 2 + T)) * 2 + ntok * CONV_DIM * 2 * 2 + CONV_DIM * (W + 1) * 2
    conv_call = lambda: cuda_ops.causal_conv1d_update(xc, conv_state, w, b, qsl, idx, acc)  # noqa: E731
    kc_ms, kc_call_ms = time_ms_graph(conv_call), time_ms(conv_call)
    kc_nopdl_ms = time_ms_graph(lambda: conv_nopdl(xc, conv_state, w, b, qsl, idx, acc))
    ec_ms = time_ms(lambda: eager_conv(xc, conv_state, w, b, idx, acc, T), reps=5)
    kc_cold_ms = conv_cold_ms(batch, k, acc, qsl, w, b, conv_bytes)
    kc_nopdl_cold_ms = conv_cold_ms(batch, k, acc, qsl, w, b, conv_bytes, pdl=False)
    gbps = lambda nbytes, ms: nbytes / ms / 1e6  # noqa: E731
    # A copy moving the same bytes (half read, half written), timed the same way: what a kernel of
    # this size can reach at all (small steps are bound by latency and launch, not bandwidth).
    src = torch.empty(conv_bytes // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    same_copy_gbps = gbps(conv_bytes, time_ms_graph(lambda: dst.copy_(src)))
    ck_ms, ck_cold_ms = copy_kernel_ms(conv_bytes)
    return {
        "batch": batch, "k": k,
        "ssu_kernel_ms": k_ms, "ssu_kernel_gbps": gbps(ssu_bytes, k_ms), "ssu_kernel_frac_copy": gbps(ssu_bytes, k_ms) / copy_gbps,
        "ssu_kernel_eager_call_ms": k_call_ms, "ssu_eager_ms": e_ms, "ssu_eager_gbps": gbps(ssu_bytes, e_ms),
        "conv_kernel_ms": kc_ms, "conv_kernel_gbps": gbps(conv_bytes, kc_ms), "conv_kernel_frac_copy": gbps(conv_bytes, kc_ms) / copy_gbps,
        "conv_kernel_cold_ms": kc_cold_ms, "conv_kernel_cold_frac_copy": gbps(conv_bytes, kc_cold_ms) / copy_gbps,
        "conv_kernel_nopdl_ms": kc_nopdl_ms, "conv_kernel_nopdl_frac_copy": gbps(conv_bytes, kc_nopdl_ms) / copy_gbps,
        "conv_kernel_nopdl_cold_ms": kc_nopdl_cold_ms,
        "conv_kernel_nopdl_cold_frac_copy": gbps(conv_bytes, kc_nopdl_cold_ms) / copy_gbps,
        "copy_kernel_same_size_ms": ck_ms, "copy_kernel_same_size_frac_copy": gbps(conv_bytes, ck_ms) / copy_gbps,
        "copy_kernel_same_size_cold_ms": ck_cold_ms,
        "copy_kernel_same_size_cold_frac_copy": gbps(conv_bytes, ck_cold_ms) / copy_gbps,
        "conv_kernel_eager_call_ms": kc_call_ms, "conv_eager_ms": ec_ms,
        "conv_same_size_copy_gbps": same_copy_gbps, "conv_kernel_frac_same_size_copy": gbps(conv_bytes, kc_ms) / same_copy_gbps, "conv_eager_gbps": gbps(conv_bytes, ec_ms),
    }


def conv_nopdl(x, conv_state, w, b, qsl, idx, acc) -> torch.Tensor:
    """causal_conv1d_update with an ordinary launch instead of PDL (the same wrapper)."""
    return cuda_ops.causal_conv1d_update(x, conv_state, w, b, qsl, idx, acc, pdl=False)


def cold_copies(nbytes: int) -> int:
    """How many copies of a call's data the cold timings cycle through: >= 150 MB, 20..256 calls."""
    return min(256, max(20, -(-150_000_000 // nbytes)))


def copy_kernel_ms(nbytes: int) -> tuple[float, float]:
    """A plain copy kernel moving nbytes (nbytes / 2 read, as much written): PyTorch's elementwise
    kernel (torch.neg on fp32, 16-byte accesses; a same-dtype copy_ would be a memcpy node instead,
    2.5 vs 1.9 us at batch 64, k = 0), timed hot (one buffer pair) and cold (cycling through
    cold_copies pairs, like conv_cold_ms)."""
    copies, n = cold_copies(nbytes), nbytes // 2 // 4
    src = torch.randn(copies, n, device="cuda")
    dst = torch.empty_like(src)
    hot = time_ms_graph(lambda: torch.neg(src[0], out=dst[0]))
    turn = itertools.count()

    def call() -> None:
        c = next(turn) % copies
        torch.neg(src[c], out=dst[c])

    return hot, time_ms_graph(call, inner=copies)


def conv_cold_ms(batch: int, k: int, acc: torch.Tensor, qsl: torch.Tensor, w: torch.Tensor, b: torch.Tensor,
                 conv_bytes: int, pdl: bool = True) -> float:
    """conv update time with its state and inputs out of L2: the graph's calls cycle through enough
    copies of them (>= 150 MB, at most 256 copies) that each call finds its data in HBM, as in a
    model step where the other layers' weights have passed through L2 since. The plain graph timing
    replays one copy, which stays in the 50 MB L2 (fractions of copy above 1 at large batches)."""
    T = 1 + k
    slots = batch * T
    copies = cold_copies(conv_bytes)
    state = torch.randn(copies * slots, W - 1 + k, CONV_DIM, device="cuda", dtype=torch.bfloat16)
    xs = torch.randn(copies, batch * T, CONV_DIM, device="cuda", dtype=torch.bfloat16)
    base = torch.arange(slots, dtype=torch.int32, device="cuda").view(batch, T)
    idxs = [base + c * slots for c in range(copies)]
    turn = itertools.count()

    def call() -> torch.Tensor:
        c = next(turn) % copies
        if not pdl:
            return conv_nopdl(xs[c], state, w, b, qsl, idxs[c], acc)
        return cuda_ops.causal_conv1d_update(xs[c], state, w, b, qsl, idxs[c], acc)

    return time_ms_graph(call, inner=copies)


def bench_prefill_scan(rows: int, length: int) -> dict:
    """Prefill scan (final state only) of `rows` prompts of `length` tokens: the GPU kernel against
    the chunked PyTorch reference (chunk 256) on the GPU, same inputs."""
    from pyengine.ops import reference

    bf, ntok = torch.bfloat16, rows * length
    qsl = torch.arange(0, ntok + 1, length, dtype=torch.int32, device="cuda")
    idx = torch.arange(rows, dtype=torch.int32, device="cuda").view(rows, 1)
    acc = torch.ones(rows, dtype=torch.int32, device="cuda")
    init = torch.zeros(rows, dtype=torch.bool, device="cuda")
    state = torch.zeros(rows, H, P, N, device="cuda")
    x = torch.randn(ntok, H, P, device="cuda", dtype=bf)
    dt = torch.randn(ntok, H, device="cuda", dtype=bf)
    B, C = (torch.randn(ntok, G, N, device="cuda", dtype=bf) for _ in range(2))
    A, D, bias = -torch.rand(H, device="cuda") - 0.5, torch.randn(H, device="cuda"), torch.randn(H, device="cuda")
    kernel_ms = time_ms(lambda: cuda_ops.ssd_chunk_scan(x, dt, A, B, C, D, None, bias, qsl, state, idx, acc, init, 256),
                        reps=5)
    ref_ms = time_ms(lambda: reference.ssd_chunk_scan(x, dt, A, B, C, D, None, bias, qsl, state, idx, acc, init,
                                                          256), reps=3, warmup=1)
    return {"rows": rows, "length": length, "kernel_ms": kernel_ms, "reference_chunked_ms": ref_ms,
            "kernel_tokens_per_s": ntok / kernel_ms * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--batches", default="1,4,16,64,128,256")
    args = ap.parse_args()
    copy_gbps = copy_bandwidth_gbps()
    results = []
    for k in (0, 3):
        for batch in map(int, args.batches.split(",")):
            r = bench(batch, k, copy_gbps)
            results.append(r)
            print(f"k={k} batch={batch:4d}  ssu {r['ssu_kernel_gbps']:7.0f} GB/s ({r['ssu_kernel_frac_copy']:.2f} of copy, "
                  f"eager {r['ssu_eager_gbps']:6.0f})  conv {r['conv_kernel_gbps']:7.0f} GB/s "
                  f"({r['conv_kernel_frac_copy']:.2f}, {r['conv_kernel_frac_same_size_copy']:.2f} of a same-size copy, "
                  f"eager {r['conv_eager_gbps']:6.0f}); conv of copy hot/cold {r['conv_kernel_frac_copy']:.2f}/"
                  f"{r['conv_kernel_cold_frac_copy']:.2f} (no PDL {r['conv_kernel_nopdl_frac_copy']:.2f}/"
                  f"{r['conv_kernel_nopdl_cold_frac_copy']:.2f}), same-size copy kernel "
                  f"{r['copy_kernel_same_size_frac_copy']:.2f}/{r['copy_kernel_same_size_cold_frac_copy']:.2f}",
                  flush=True)
    prefill = []
    for rows, length in ((1, 2048), (8, 512)):
        r = bench_prefill_scan(rows, length)
        prefill.append(r)
        print(f"prefill scan {rows} x {length}: kernel {r['kernel_ms']:.3f} ms, chunked reference "
              f"{r['reference_chunked_ms']:.3f} ms", flush=True)
    doc = {**run_header(),
           "copy_gbps": copy_gbps, "shapes": {"H": H, "P": P, "N": N, "G": G, "conv_dim": CONV_DIM, "W": W},
           "results": results, "prefill_scan": prefill, "note": "end-to-end Mamba2-2.7B decode: benchmarks/bench_mamba2_decode.py"}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
    json.dump({"copy_gbps": copy_gbps}, sys.stdout)
    print()


if __name__ == "__main__":
    main()
