"""Speculation on the GPU with and without ragged verify steps on CUDA graphs: SmolLM2 (the default
GGUF), Spec-Bench prompts (first turn, chat template), greedy, plain decoding vs ngram (k = 4,
adaptive and fixed), each speculative method with KernelConfig.graph_ragged_verify on (a verify
step whose rows carry different draft counts replays the graph of its longest row) and off (such
steps run eagerly, as before), all in one run. Reports tokens/s, the ratio to plain decoding,
steps replayed vs eager, where the time went (steps and seconds by kind: replayed or eager, with
drafts or not, with a prefill row or not; a step with prefill rows on prefill graphs counts as
replayed), steps launched ahead (async; "_device": built by the device loop, "_ahead": predicted by
verify ahead; methods ending in "_host" run without the device loop), the measured graph replay times the draft-length policy
weighs (by bucket, q = 1..k+1) and whether every output equals plain decoding's. With
--per-category N: N prompts of each Spec-Bench category, interleaved, and at batch 1 (one request
at a time) tokens/s and the ratio to plain by category; --eagle3 DIR adds an EAGLE-3 head.
--repeats N runs every method N times, a fresh LLM each, the methods taking turns within each
round (the spread between runs of one tree is a few percent at batch 16 and 64, more than many
changes' effect: docs/speculation.md); each method then reports its median run, every run's
tokens/s and the ratio to plain round by round. benchmarks/plot_spec.py draws a result as a PNG. --device cpu runs the same comparison on the CPU
(no graphs there: the graph fields stay 0 and every step counts as eager); a method name ending
in "_avx2" or "_avx512" runs it with KernelConfig.cpu_qdot_isa so (the int16-limb linears on AVX2 or
AVX-512 VNNI where AMX would run; the same bits).

    python3 benchmarks/bench_spec_gpu.py --gguf PATH --prompts spec_bench.jsonl --out results.json
    python benchmarks/bench_spec_gpu.py --device cpu --gguf PATH --prompts spec_bench.jsonl --batches 1 --per-category 2
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.gpu_timing import run_header, write_result  # noqa: E402
from pyengine import LLM, SamplingParams  # noqa: E402

METHODS = {
    "plain": (None, True),
    "ngram_adaptive": ({"method": "ngram", "num_speculative_tokens": 4}, True),
    "ngram_adaptive_ragged_eager": ({"method": "ngram", "num_speculative_tokens": 4}, False),
    "ngram_fixed": ({"method": "ngram", "num_speculative_tokens": 4, "adaptive_draft_length": False}, True),
    "ngram_adaptive_k8": ({"method": "ngram", "num_speculative_tokens": 8}, True),
    "ngram_adaptive_k16": ({"method": "ngram", "num_speculative_tokens": 16}, True),
    # "_host": without the device loop (EngineConfig.device_verify off: verify ahead's predictions instead)
    "ngram_adaptive_host": ({"method": "ngram", "num_speculative_tokens": 4}, True),
    "ngram_fixed_host": ({"method": "ngram", "num_speculative_tokens": 4, "adaptive_draft_length": False}, True),
    "suffix_adaptive_host": ({"method": "suffix", "num_speculative_tokens": 4}, True),
    # "_device": the device loop at every batch size (past its max_rows)
    "suffix_adaptive_device": ({"method": "suffix", "num_speculative_tokens": 4}, True),
    "ngram_adaptive_device": ({"method": "ngram", "num_speculative_tokens": 4}, True),
    "ngram_fixed_ragged_eager": ({"method": "ngram", "num_speculative_tokens": 4, "adaptive_draft_length": False}, False),
    "suffix_adaptive": ({"method": "suffix", "num_speculative_tokens": 4}, True),
    "suffix_fixed": ({"method": "suffix", "num_speculative_tokens": 4, "adaptive_draft_length": False}, True),
    # the lookups from two matched tokens (the default before 2026-11-28)
    "suffix_adaptive_lookup2": ({"method": "suffix", "num_speculative_tokens": 4, "prompt_lookup_min": 2}, True),
    "suffix_adaptive_k16_lookup2": ({"method": "suffix", "num_speculative_tokens": 16, "prompt_lookup_min": 2}, True),
    "ngram_adaptive_lookup2": ({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2}, True),
    # longer drafts where the suffix tree matches far (copy-heavy text); the policy prices each length
    "suffix_adaptive_k8": ({"method": "suffix", "num_speculative_tokens": 8}, True),
    "suffix_adaptive_k16": ({"method": "suffix", "num_speculative_tokens": 16}, True),
    # ... and drafts past the matched context's length (suffix_decoding_max_spec_factor: 1 by default)
    "suffix_adaptive_k8_f2": ({"method": "suffix", "num_speculative_tokens": 8,
                               "suffix_decoding_max_spec_factor": 2.0}, True),
    "suffix_adaptive_k16_f2": ({"method": "suffix", "num_speculative_tokens": 16,
                                "suffix_decoding_max_spec_factor": 2.0}, True),
    "suffix_adaptive_k16_f4": ({"method": "suffix", "num_speculative_tokens": 16,
                                "suffix_decoding_max_spec_factor": 4.0}, True),
    "suffix_adaptive_f4": ({"method": "suffix", "num_speculative_tokens": 4,
                            "suffix_decoding_max_spec_factor": 4.0}, True),
}


def time_steps(llm: LLM, per_request: dict) -> dict:
    """Wrap llm.engine.step: wall seconds and counts per step kind, filled while the LLM runs. The
    seconds since the last request finished go to the request(s) finishing (per_request: request
    id -> seconds): at batch 1, where requests run one after another, each request's own time."""
    engine, kinds = llm.engine, {}
    step = engine.step
    since_finish = [0.0]
    graphs = engine.runner.graph_runner  # None on the CPU

    def timed() -> list:
        verify0, prefill0 = engine.scheduler.stats()["num_verify_rows"], engine.counters["prefill_tokens"]
        used0 = engine.verify_ahead.num_used if engine.verify_ahead is not None else 0
        device0 = engine.device_verify.num_used if engine.device_verify is not None else 0
        mixed0 = graphs.num_mixed if graphs else 0
        start = time.perf_counter()
        out = step()
        seconds = time.perf_counter() - start
        graphed = graphs is not None and (engine.runner.last_graph_key is not None or graphs.num_mixed > mixed0)
        kind = "graph" if graphed else "eager"
        kind += "_prefill" if engine.counters["prefill_tokens"] > prefill0 else ""
        kind += "_drafts" if engine.scheduler.stats()["num_verify_rows"] > verify0 else ""
        kind += "_ahead" if engine.verify_ahead is not None and engine.verify_ahead.num_used > used0 else ""
        kind += "_device" if engine.device_verify is not None and engine.device_verify.num_used > device0 else ""
        k = kinds.setdefault(kind, {"steps": 0, "seconds": 0.0})
        k["steps"] += 1
        k["seconds"] += seconds
        since_finish[0] += seconds
        done = [req.request_id for req in out if req.finished]
        for rid in done:
            per_request[rid] = since_finish[0] / len(done)
        if done:
            since_finish[0] = 0.0
        return out

    engine.step = timed
    return kinds


def spec_bench_rows(path: str, per_category: int = 0, num_prompts: int = 64,
                    categories: list[str] | None = None) -> list[dict]:
    """Spec-Bench lines (of these categories only, if given): per_category N: N of each category,
    interleaved (category 1, 2, ..., 13, then the second of each, ...); 0: the first num_prompts."""
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if categories:
        rows = [r for r in rows if r.get("category") in categories]
    if not per_category:
        return rows[:num_prompts]
    by_cat: dict[str, list] = {}
    for r in rows:
        by_cat.setdefault(r["category"], []).append(r)
    picked = [cat[:per_category] for cat in by_cat.values()]
    depth = max((len(c) for c in picked), default=0)
    return [c[i] for i in range(depth) for c in picked if i < len(c)]


def run_method(args, name: str, batch: int, prompts: list[str], categories: list[str],
               params: SamplingParams) -> tuple[dict, list]:
    """One timed run of METHODS[name] at this batch size on a fresh LLM (warm-up first): its row
    entry (without identical_to_plain) and every request's tokens."""
    cuda = args.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    spec, ragged = METHODS[name]
    isa = next((i for i in ("avx2", "avx512") if name.endswith("_" + i)), "amx")  # the CPU's int16-limb linears
    base = name.removesuffix("_" + isa)
    llm = LLM(args.gguf, device=args.device, dtype="bfloat16" if cuda else "auto", max_num_seqs=batch,
              max_model_len=2048, speculative_config=spec,
              kernel_config={"graph_ragged_verify": ragged, "cpu_qdot_isa": isa})
    if base.endswith("_host"):
        llm.engine.device_verify = None
    elif base.endswith("_device"):
        llm.engine.device_verify.max_rows = 1 << 30
    conversations = [[{"role": "user", "content": q}] for q in prompts]
    # warm-up: --capture all: every graph captured first (LLMEngine.capture_graphs), else the
    # ones the run needs on first use; then the timed prompts with their words reversed (same
    # lengths, nothing a prefix or suffix cache could reuse)
    mirrored = [[{"role": "user", "content": " ".join(q.split()[::-1])}] for q in prompts]
    g = llm.engine.runner.graph_runner
    capture_s = time.perf_counter()
    captured = llm.engine.capture_graphs() if args.capture == "all" else 0
    capture_s = time.perf_counter() - capture_s
    llm.chat(mirrored, params, use_tqdm=False)
    replays0, steps0, async0 = g.num_replays if g else 0, llm.stats()["num_steps"], llm.engine.num_async_steps
    graphs0 = len(g.graphs) if g else 0
    va = getattr(llm.engine, "verify_ahead", None)
    va0 = (va.num_launched, va.num_confirmed, va.num_used) if va is not None else None
    loop = getattr(llm.engine, "device_verify", None)
    loop0 = (loop.num_launched, loop.num_used) if loop is not None else None
    per_request: dict = {}
    kinds = time_steps(llm, per_request)
    sync()
    start = time.perf_counter()
    outs = llm.chat(conversations, params, use_tqdm=False)
    sync()
    seconds = time.perf_counter() - start
    tokens = [o.outputs[0].token_ids for o in outs]
    stats = llm.stats()
    one = {"tokens_per_s": round(sum(map(len, tokens)) / seconds, 1),
           "graph_steps": (g.num_replays if g else 0) - replays0, "steps": stats["num_steps"] - steps0,
                 "acceptance_rate": stats.get("acceptance_rate"),
                 "async_steps": llm.engine.num_async_steps - async0,
                 "replay_ms_by_q": {b: [round(1e3 * t, 3) for t in v]
                                    for b, v in (g.replay_seconds.items() if g else ())},
                 "step_kinds": {k: {"steps": v["steps"], "ms": round(1e3 * v["seconds"], 1)}
                                for k, v in sorted(kinds.items())},
                 "graphs_captured_up_front": captured, "capture_s": round(capture_s, 2),
                 "graphs_captured_in_timed_run": (len(g.graphs) if g else 0) - graphs0}
    if va is not None:  # verify steps launched ahead in the timed run, whose prediction held, used
        one["verify_ahead"] = {"launched": va.num_launched - va0[0], "confirmed": va.num_confirmed - va0[1],
                               "used": va.num_used - va0[2]}
    if loop is not None:  # verify steps built on the device in the timed run, and used
        one["device_verify"] = {"launched": loop.num_launched - loop0[0], "used": loop.num_used - loop0[1]}
    if batch == 1 and args.per_category:  # one request at a time: its own seconds
        cat_tokens: dict = {}
        for o, cat in zip(outs, categories):
            t, sec = cat_tokens.get(cat, (0, 0.0))
            cat_tokens[cat] = (t + len(o.outputs[0].token_ids), sec + per_request.get(o.request_id, 0.0))
        one["tokens_per_s_by_category"] = {c: round(t / sec, 1) for c, (t, sec) in cat_tokens.items()}
    del llm
    if cuda:
        torch.cuda.empty_cache()
    return one, tokens


def median_run(runs: list[dict]) -> dict:
    """The run of median tokens/s (the lower of the two middle ones for an even count), with every
    run's tokens/s beside it when there were several, and identical_to_plain over all of them."""
    ordered = sorted(runs, key=lambda r: r["tokens_per_s"])
    out = dict(ordered[(len(ordered) - 1) // 2])
    out["identical_to_plain"] = all(r["identical_to_plain"] for r in runs)
    if len(runs) > 1:
        out["tokens_per_s_runs"] = [r["tokens_per_s"] for r in runs]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--prompts", required=True, help="Spec-Bench jsonl (turns[0] of each line)")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--per-category", type=int, default=0,
                    help="N prompts of each Spec-Bench category, interleaved (0: the first --num-prompts)")
    ap.add_argument("--category", default="",
                    help="only these Spec-Bench categories (comma-separated; e.g. one task at batch 64)")
    ap.add_argument("--eagle3", help="an EAGLE-3 head directory: adds methods eagle3_adaptive and eagle3_fixed")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--capture", default="all", choices=["all", "lazy"],
                    help="all: every CUDA graph captured before the warm-up; lazy: on first use")
    ap.add_argument("--repeats", type=int, default=1, help="runs of every method, taking turns (median reported)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    if "plain" not in args.methods.split(","):
        ap.error("--methods must include plain (every ratio is to it)")
    cuda = args.device == "cuda"
    if args.eagle3:
        METHODS["eagle3_adaptive"] = ({"method": "eagle3", "model": args.eagle3, "num_speculative_tokens": 4}, True)
        METHODS["eagle3_fixed"] = ({"method": "eagle3", "model": args.eagle3, "num_speculative_tokens": 4,
                                    "adaptive_draft_length": False}, True)  # every step drafts: the drafting step's cost
        for name in ("eagle3_adaptive", "eagle3_fixed"):  # the head's drafts on the host's paths
            METHODS[name + "_host"] = METHODS[name]
    for name in list(METHODS):  # the same with the CPU's linears on lower kernels (KernelConfig.cpu_qdot_isa)
        METHODS[name + "_avx2"] = METHODS[name + "_avx512"] = METHODS[name]
    unknown = [m for m in args.methods.split(",") if m not in METHODS]
    if unknown:
        ap.error(f"unknown --methods {unknown} (known: {sorted(METHODS)}; eagle3_adaptive needs --eagle3 DIR)")
    categories = [c for c in args.category.split(",") if c]
    rows_in = spec_bench_rows(args.prompts, args.per_category, args.num_prompts, categories)
    if not rows_in:
        ap.error(f"no Spec-Bench prompts in categories {categories}")
    questions = [r["turns"][0] for r in rows_in]
    categories = [r.get("category", "") for r in rows_in]
    if cuda:
        header = run_header()
    else:  # the CPU benchmarks' header (bench_load.machine) with the date and command run_header gives
        from benchmarks.bench_load import loadavg, machine
        header = dict(machine(), device="cpu", date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                      command="python " + " ".join(sys.argv), torch=torch.__version__)
    result = dict(header, prompts=len(questions), max_tokens=args.max_tokens, rows=[])
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    for batch in [int(b) for b in args.batches.split(",")]:
        if args.per_category:
            prompts = questions
        else:
            prompts = questions[:max(batch, min(len(questions), 4 * batch))] if batch > 1 else questions[:8]
        row: dict = {"batch": batch, "num_prompts": len(prompts)}
        names = [n for n in METHODS if n in args.methods.split(",")]
        runs: dict[str, list[dict]] = {n: [] for n in names}
        reference = None
        for _ in range(args.repeats):
            for name in names:
                one, tokens = run_method(args, name, batch, prompts, categories, params)
                reference = tokens if reference is None else reference
                one["identical_to_plain"] = tokens == reference
                runs[name].append(one)
        for name in names:
            row[name] = median_run(runs[name])
        plain = row["plain"]["tokens_per_s"]
        for name in row.keys() & METHODS.keys():
            row[name]["vs_plain"] = round(row[name]["tokens_per_s"] / plain, 3)
            if args.repeats > 1:  # round by round: a method's run against plain's of the same round
                row[name]["vs_plain_runs"] = [round(m["tokens_per_s"] / p["tokens_per_s"], 3)
                                              for m, p in zip(runs[name], runs["plain"])]
            by_cat, plain_cat = row[name].get("tokens_per_s_by_category"), row["plain"].get("tokens_per_s_by_category")
            if by_cat and plain_cat:
                row[name]["vs_plain_by_category"] = {c: round(v / plain_cat[c], 3) for c, v in by_cat.items()}
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
    if not cuda:
        result["loadavg_at_end"] = loadavg()
    if args.out:
        write_result(args.out, result)


if __name__ == "__main__":
    main()
