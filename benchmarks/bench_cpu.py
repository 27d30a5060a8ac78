"""pyengine vs HF transformers `generate` on the CPU: SmolLM2-135M-Instruct (the default GGUF), fp32.

Both engines load the same GGUF file (HF: AutoModelForCausalLM.from_pretrained(dir, gguf_file=name)),
get the same prompt token ids (raw prompts, no chat template, tokenized once by pyengine) and
generate exactly --max-tokens tokens per prompt, greedily (pyengine: ignore_eos=True; HF:
min_new_tokens=max_new_tokens). HF batches are left-padded. Prefix caching is off in pyengine so
that repeated runs of the same prompts get no reuse HF does not have.

Throughput = generated tokens / wall time of the whole generate call (prefill included), best of
--repeats runs after one untimed warm-up per engine and batch size. Prints JSON last.

--bf16 adds pyengine with bf16 weights and KV cache (oneDNN bf16 matmuls on avx512_bf16 CPUs) and HF
transformers in bf16 too, so the bf16 speedup is reported both against HF fp32 (the issue's
baseline) and against HF's own bf16; the headline ratio stays fp32 vs fp32.

    python benchmarks/bench_cpu.py [--max-tokens 64] [--batch-sizes 1 16] [--threads 2] [--bf16] [--out FILE]

--invariance instead compares, in one process and taking turns, pyengine's batch-invariant CPU path
(packed GEMM on AVX-512 or AVX2 + FMA, C++ attention for every step) with the path an AVX2 CPU ran
before it (oneDNN-prepacked fp32 linears, torch.mm for bf16, whose oneDNN prepack needs AVX-512 or
AVX-NE-CONVERT; SDPA for steps over 32768 query-key pairs): decode tokens/s at each batch size
(decode only: time(1 + n tokens) - time(1 token)), the time of one prefill of --prefill-tokens
tokens, and whether a prompt's logits are bit-identical alone and next to that long prompt.

    python benchmarks/bench_cpu.py --invariance [--dtypes float32 bfloat16] [--decode-tokens 32] \
        [--prefill-tokens 1000] [--batch-sizes 1 16] [--threads 2] [--repeats 2] [--out FILE]
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import sys
import time
from typing import Any, Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pyengine import LLM, SamplingParams  # noqa: E402
from pyengine.loader import default_model_path  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_load import machine as host_machine  # noqa: E402

PROMPTS = [
    "The history of the Roman Empire begins",
    "Here is a recipe for a simple tomato soup:",
    "In computer science, a hash table is",
    "The three primary colours are",
    "Once upon a time, in a small village by the sea,",
    "Photosynthesis is the process by which plants",
    "The best way to learn a new language is",
    "Water boils at 100 degrees Celsius because",
    "A good night's sleep helps you",
    "The capital of Japan is Tokyo, and the capital of France is",
    "To write a function in Python that reverses a list,",
    "The moon orbits the Earth roughly every",
    "Mount Everest, the highest mountain in the world,",
    "The main ingredients of bread are",
    "When I opened the door, I saw",
    "Electric cars are becoming popular because",
]


def best_time(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    best, result = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - t0)
    return best, result


def machine() -> dict[str, Any]:
    return {**host_machine(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__}


@contextlib.contextmanager
def sdpa_for_long_steps():
    """The attention rule before the batch-invariant kernels: a step of more than 32768 query-key
    pairs runs the SDPA reference (op by op: the layer stack leaves such steps alone)."""
    import pyengine.ops.cpu as cpu_ops
    from pyengine.models.llama_cpu_stack import CpuLlamaStack
    from pyengine.ops import reference

    attention, applies = cpu_ops.paged_attention, CpuLlamaStack.applies

    def long_step(meta) -> bool:
        return cpu_ops.step_tables(meta)[3] > 1 << 15

    def old_attention(q, k_cache, v_cache, meta, scale, return_lse=False):
        if long_step(meta):
            return reference.paged_attention(q, k_cache, v_cache, meta, scale, return_lse=return_lse)
        return attention(q, k_cache, v_cache, meta, scale, return_lse=return_lse)

    cpu_ops.paged_attention = old_attention
    CpuLlamaStack.applies = lambda self, meta, kv_caches: applies(self, meta, kv_caches) and not long_step(meta)
    try:
        yield
    finally:
        cpu_ops.paged_attention = attention
        CpuLlamaStack.applies = applies


@contextlib.contextmanager
def before_invariance():
    """The CPU path before the batch-invariant kernels, on a CPU without AVX-512: models load with
    oneDNN / torch linears (PackedLinear unsupported) and steps of more than 32768 query-key pairs
    run the SDPA reference. Load and run the "before" engine inside this block."""
    import pyengine.ops.cpu as cpu_ops

    supported = cpu_ops.PackedLinear.supported
    cpu_ops.PackedLinear.supported = staticmethod(lambda weight: False)
    try:
        with sdpa_for_long_steps():
            yield
    finally:
        cpu_ops.PackedLinear.supported = supported


def invariance_main(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    info = machine()
    path = default_model_path()
    result: dict[str, Any] = {"model": os.path.basename(path), "machine": info, "rows": []}
    for dtype in args.dtypes:
        invariant = LLM(path, device="cpu", dtype=dtype, enable_prefix_caching=False)
        with before_invariance():
            before = LLM(path, device="cpu", dtype=dtype, enable_prefix_caching=False)
        from pyengine.ops.cpu import PackedLinear

        assert isinstance(invariant.model.packed_lm_head, PackedLinear) and invariant.model.cpu_stack is not None
        assert not isinstance(before.model.packed_lm_head, PackedLinear)
        paths = {"invariant": (invariant, contextlib.nullcontext),
                 "before": (before, before_invariance)}
        tok = invariant.tokenizer
        ids = [tok.encode(p) for p in PROMPTS]
        filler = tok.encode(" ".join(PROMPTS))
        long = (filler * (args.prefill_tokens // len(filler) + 1))[:args.prefill_tokens]

        def run(name: str, batch: list[list[int]], max_tokens: int, record: bool = False) -> list[Any]:
            engine, ctx = paths[name]
            engine.engine.cfg.record_logits = record
            params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
            with ctx():
                return engine.run_requests([(None, p) for p in batch], [params] * len(batch))

        row: dict[str, Any] = {"dtype": dtype, "isa": invariant.model.packed_lm_head.isa}
        # Bits: a prompt alone vs next to the long prompt (prefill step shared, then every decode step).
        for name in paths:
            alone = run(name, [ids[0]], 8, record=True)[0]
            mixed = run(name, [long, ids[0]], 8, record=True)[1]
            diff = max((a - b).abs().max().item() for a, b in zip(alone.logits, mixed.logits))
            row[f"{name}_logits_bit_identical"] = diff == 0 and alone.output_token_ids == mixed.output_token_ids
            row[f"{name}_logits_max_abs_diff"] = diff
        for bs in args.batch_sizes:
            batch = ids[:bs]
            for name in paths:
                slow = name == "before" and dtype == "bfloat16"  # torch.mm bf16 without AVX-512: seconds a step
                n = args.decode_tokens_slow if slow else args.decode_tokens
                repeats = 1 if slow else args.repeats
                run(name, batch, 2)  # warm-up
                t1, _ = best_time(lambda: run(name, batch, 1), repeats)
                tn, _ = best_time(lambda: run(name, batch, 1 + n), repeats)
                row[f"batch_{bs}_{name}_decode_tok_s"] = round(bs * n / (tn - t1), 2)
                row[f"batch_{bs}_{name}_decode_tokens"] = n
                print(json.dumps({dtype: {k: v for k, v in row.items() if k.startswith(f"batch_{bs}_{name}")}}),
                      file=sys.stderr, flush=True)
            row[f"batch_{bs}_decode_speedup_vs_before"] = round(row[f"batch_{bs}_invariant_decode_tok_s"]
                                                                / row[f"batch_{bs}_before_decode_tok_s"], 3)
        # Prefill also with the packed GEMM but the old attention rule (SDPA for the long step), the
        # path an AVX-512 CPU ran before: the fastest non-invariant prefill here.
        paths["packed_sdpa"] = (invariant, sdpa_for_long_steps)
        for name in paths:
            slow = name == "before" and dtype == "bfloat16"
            run(name, [long[:64]], 1)  # warm-up
            seconds, _ = best_time(lambda: run(name, [long], 1), 1 if slow else args.repeats)
            row[f"prefill_{args.prefill_tokens}_{name}_s"] = round(seconds, 3)
            print(json.dumps({dtype: {f"prefill_{name}_s": round(seconds, 3)}}), file=sys.stderr, flush=True)
        prefill = {name: row[f"prefill_{args.prefill_tokens}_{name}_s"] for name in paths}
        row["prefill_speedup_vs_before"] = round(prefill["before"] / prefill["invariant"], 3)
        row["prefill_invariant_over_fastest"] = round(prefill["invariant"] / min(prefill.values()), 3)
        result["rows"].append(row)
        del invariant, before, paths
    result.update({
        "metric": "decode tok/s = batch * n / (time(1 + n new tokens) - time(1 new token)), best of --repeats "
                  "(1 for the slow bf16 'before' path), greedy, short prompts; prefill = wall time of one "
                  f"{args.prefill_tokens}-token prompt with 1 new token",
        "paths": {"invariant": "packed GEMM (AVX2 + FMA here) + C++ attention for every step, layer stack",
                  "before": "oneDNN-prepacked fp32 / torch.mm bf16 linears, C++ attention but SDPA for steps over "
                            "32768 query-key pairs, op-by-op layers (what this CPU ran before)",
                  "packed_sdpa": "prefill only: packed GEMM, SDPA for the long step (the old attention rule)"},
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python", "benchmarks/bench_cpu.py", *sys.argv[1:]]),
    })
    emit(result, args.out)


def emit(result: dict, out: str | None) -> None:
    """The JSON report on stdout, and at `out` when given."""
    text = json.dumps(result, indent=1)
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    print(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (both engines)")
    ap.add_argument("--repeats", type=int, default=2, help="timed runs per engine and batch size; best is kept")
    ap.add_argument("--bf16", action="store_true",
                    help="also time pyengine with bf16 weights and KV (dtype='bfloat16'), against the same fp32 HF")
    ap.add_argument("--out", help="also write the JSON here")
    ap.add_argument("--invariance", action="store_true",
                    help="batch-invariant CPU path vs the path before it (see the module docstring); no HF")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    ap.add_argument("--decode-tokens", type=int, default=32, help="--invariance: decode tokens timed per run")
    ap.add_argument("--decode-tokens-slow", type=int, default=4,
                    help="--invariance: decode tokens for the bf16 'before' path (torch.mm bf16, very slow)")
    ap.add_argument("--prefill-tokens", type=int, default=1000, help="--invariance: tokens of the timed prefill")
    args = ap.parse_args()
    if args.invariance:
        return invariance_main(args)
    if args.max_tokens < 1 or args.repeats < 1 or min(args.batch_sizes) < 1 or max(args.batch_sizes) > len(PROMPTS):
        ap.error(f"need --max-tokens >= 1, --repeats >= 1 and batch sizes in 1..{len(PROMPTS)}")
    torch.set_num_threads(args.threads)
    info = machine()
    n = args.max_tokens
    path = default_model_path()

    llm = LLM(path, device="cpu", dtype="float32", enable_prefix_caching=False)
    tok = llm.tokenizer
    ids = [tok.encode(p) for p in PROMPTS]

    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                           dtype=torch.float32).eval()
    pad_id = tok.eos_token_ids[0] if tok.eos_token_ids else 0

    def run_pyengine(batch: list[list[int]], max_tokens: int, engine: LLM = llm) -> list[list[int]]:
        outs = engine.generate(batch, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                               use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]

    engines: list[tuple[str, Callable[[list[list[int]], int], list[list[int]]]]] = [("pyengine", run_pyengine)]
    if args.bf16:
        llm_bf16 = LLM(path, device="cpu", dtype="bfloat16", enable_prefix_caching=False)
        engines.append(("pyengine_bf16", lambda batch, max_tokens: run_pyengine(batch, max_tokens, llm_bf16)))

    hf_models = [("hf", hf)]
    if args.bf16:
        hf_models.append(("hf_bf16", transformers.AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.bfloat16).eval()))

    @torch.inference_mode()
    def run_hf(batch: list[list[int]], max_tokens: int, hf=hf) -> list[list[int]]:
        width = max(len(p) for p in batch)
        input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch])  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        out = hf.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=max_tokens,
                          min_new_tokens=max_tokens, do_sample=False, pad_token_id=pad_id)
        return out[:, width:].tolist()

    result: dict[str, Any] = {}
    for bs in args.batch_sizes:
        batch = ids[:bs]
        row: dict[str, Any] = {"batch_size": bs, "new_tokens_per_prompt": n,
                               "prompt_tokens": sum(len(p) for p in batch)}
        hf_engines = [(name, lambda b, m, model=model: run_hf(b, m, model)) for name, model in hf_models]
        for name, fn in engines + hf_engines:
            fn(batch, 4)  # warm-up (allocators, oneDNN primitives), untimed
            seconds, tokens = best_time(lambda: fn(batch, n), args.repeats)
            assert [len(t) for t in tokens] == [n] * bs, f"{name} did not generate exactly {n} tokens per prompt"
            row[f"{name}_s"] = round(seconds, 4)
            row[f"{name}_tok_s"] = round(bs * n / seconds, 2)
            row[f"{name}_tokens"] = tokens
        row["ratio"] = round(row["pyengine_tok_s"] / row["hf_tok_s"], 3)
        if args.bf16:
            row["ratio_bf16_vs_hf_fp32"] = round(row["pyengine_bf16_tok_s"] / row["hf_tok_s"], 3)
            row["ratio_bf16_vs_hf_bf16"] = round(row["pyengine_bf16_tok_s"] / row["hf_bf16_tok_s"], 3)
            row.pop("pyengine_bf16_tokens")
            row.pop("hf_bf16_tokens")
        # Informational: how far the two fp32 greedy continuations agree (first divergence per prompt).
        agree = []
        for a, b in zip(row.pop("pyengine_tokens"), row.pop("hf_tokens")):
            agree.append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), n))
        row["greedy_prefix_agreement_mean"] = round(sum(agree) / len(agree) / n, 3)
        result[f"batch_{bs}"] = row
        print(json.dumps({f"batch_{bs}": row}), file=sys.stderr)

    result.update({
        "model": os.path.basename(path),
        "dtype": "float32",
        "metric": "generated tokens / wall time of the whole generate call (prefill included), best of "
                  f"{args.repeats} after a warm-up; greedy, exactly {n} new tokens per prompt",
        "machine": info,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python", "benchmarks/bench_cpu.py", *sys.argv[1:]]),
        "transformers": transformers.__version__,
    })
    emit(result, args.out)


if __name__ == "__main__":
    main()
