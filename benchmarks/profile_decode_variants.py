"""Which part of the invariant mode costs a small model's decode step (issue 18: SmolLM2 at batch
16 / 64): the step's GPU time on CUDA graphs (bench_decode.run_pyengine: graph_forward_ms, one
captured decode forward replayed on an idle GPU; and the median step) for the default mode, the
invariant mode, and invariant runs with one piece swapped, each on a fresh LLM whose graphs are
captured with the swap in place. Swaps are experiments, not engine options: the GEMM ones patch
pyengine.ops.cuda (linear / gemm.invariant_gemm) for the run and restore it.

  default          LLM(batch_invariant=False)
  invariant        LLM(batch_invariant=True)
  inv_cublas       invariant, but every projection on cuBLAS (attention, norms as invariant)
  def_invgemm      default, but every projection on the invariant GEMM
  inv_nopdl        invariant, the invariant GEMMs launched without PDL
  inv_tile_RxC     invariant, the mma.sync family's output tile forced to R x C up to 64 rows
                   (a launch choice: no bit changes)
  inv_split_A_B    invariant, K split A for the projections of K <= 1024 but the lm_head (SmolLM2's
                   qkv / o / gate_up) and B for the others (its down), at every M: other bits, as
                   a change of invariant_gemm_split would give

    python3 benchmarks/profile_decode_variants.py [--variants default,invariant,...] [--batches 16,64]
        [--gguf PATH] [--out PATH]
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import os
import sys
from collections.abc import Iterator

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_decode import SMOLLM2_HF, llm_from_model, random_llama, run_pyengine  # noqa: E402
from gpu_timing import run_header, write_result  # noqa: E402

import pyengine.ops.cuda as cuda_ops  # noqa: E402
import pyengine.ops.cuda.gemm as gemm_mod  # noqa: E402
from pyengine import LLM  # noqa: E402
from pyengine.ops.cuda.launch import aligned_rows, kernels, num_sms, params, row_stride, stream  # noqa: E402


@contextlib.contextmanager
def patched(obj: object, name: str, value: object) -> Iterator[None]:
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def invariant_gemm_with(tile: tuple[int, int] = (0, 0), pdl: bool = True, max_rows: int = 64,
                        splits: tuple[int, int] | None = None):
    """gemm.invariant_gemm with its mma.sync tile forced up to max_rows rows, PDL as given and
    (splits) the K split of short-K projections / the others forced (lm_head-wide N keeps its own)."""
    def run(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, **_: object) -> torch.Tensor:
        x = aligned_rows(x)
        m, k, n = x.shape[0], x.shape[1], w.shape[1]
        y = torch.empty(m, n, dtype=x.dtype, device=x.device)
        t = tile if m <= max_rows else (0, 0)
        split = 0
        if splits is not None and n < 16384:
            split = splits[0] if k <= 1024 else splits[1]
        p = params(kernels.InvariantGemmParams, x=x.data_ptr(), w=w.data_ptr(), bias=0 if bias is None else bias.data_ptr(),
                   y=y.data_ptr(), m=m, n=n, k=k, x_stride=row_stride(x), y_stride=row_stride(y),
                   dtype=1 if x.dtype == torch.bfloat16 else 0, num_sms=num_sms(x.device), pdl=pdl,
                   tile_m=t[0], tile_n=t[1], split=split)
        rc = kernels.invariant_gemm(p, stream(x.device))
        if rc not in (None, 0):
            raise RuntimeError(f"invariant_gemm returned {rc}")
        return y
    return run


def variant(name: str) -> tuple[bool, contextlib.AbstractContextManager]:
    """(batch_invariant, the patch in force while the LLM is built and run)."""
    if name == "default":
        return False, contextlib.nullcontext()
    if name == "invariant":
        return True, contextlib.nullcontext()
    if name == "inv_cublas":
        return True, patched(cuda_ops, "linear", lambda x, w, bias=None: None)
    if name == "def_invgemm":
        return False, patched(cuda_ops, "linear", lambda x, w, bias=None: gemm_mod.invariant_gemm(x, w, bias))
    if name == "inv_nopdl":
        return True, patched(gemm_mod, "invariant_gemm", invariant_gemm_with(pdl=False))
    if name.startswith("inv_tile_"):
        r, c = (int(v) for v in name[len("inv_tile_"):].split("x"))
        return True, patched(gemm_mod, "invariant_gemm", invariant_gemm_with(tile=(r, c)))
    if name.startswith("inv_split_"):
        a, b = (int(v) for v in name[len("inv_split_"):].split("_"))
        return True, patched(gemm_mod, "invariant_gemm", invariant_gemm_with(splits=(a, b)))
    raise ValueError(f"unknown variant {name}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default="default,invariant,inv_cublas,def_invgemm,inv_nopdl")
    ap.add_argument("--batches", default="16,64")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--gguf", default=None, help="SmolLM2 GGUF (default: random SmolLM2-shaped weights)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    model = cfg = None
    if args.gguf is None:
        model, cfg = random_llama(SMOLLM2_HF, torch.bfloat16)
    result = run_header() | {"weights": args.gguf or "random", "variants": {}}
    for name in args.variants.split(","):
        invariant, patch = variant(name)
        with patch:
            kw = dict(device="cuda", num_kv_blocks=2048 + max(batches) * 16, max_model_len=1024,
                      max_num_seqs=max(batches), batch_invariant=invariant, dtype=torch.bfloat16)
            llm = LLM(model=args.gguf, **kw) if model is None else llm_from_model(model, cfg, **kw)
            rows = {}
            for b in batches:
                r = run_pyengine(llm, b, 32, args.new_tokens, llm.model_config.vocab_size)
                rows[str(b)] = {k: r[k] for k in ("graph_forward_ms", "median_step_ms")}
            del llm
            gc.collect()
            torch.cuda.empty_cache()
        result["variants"][name] = rows
        print(f"{name:16s} " + "  ".join(f"b{b}: graph {v['graph_forward_ms']:.3f} ms step {v['median_step_ms']:.3f} ms"
                                         for b, v in rows.items()), flush=True)
    if args.out:
        write_result(args.out, result)


if __name__ == "__main__":
    main()
