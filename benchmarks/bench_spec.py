"""Plain vs ngram vs draft-model speculation on SmolLM2: grounded prompts (edit code, copy with
changes, extract from a passage) and open prompts, at several batch sizes. Greedy, fixed token
counts; every prompt of a set is used at every batch size (batch 1 runs them one at a time). Prints
one JSON document last. The methods of a cell take turns run by run, and each keeps
its best run.

    python benchmarks/bench_spec.py --batch-sizes 1 8 32 --max-tokens 96 [--draft-model PATH | --draft-layers N]

--num-spec-tokens stays 4 by default: on the 2-core CPU a verify token costs about 0.8 ms against
a 21 ms batch-1 step, and 6 or 8 drafts were no faster on these prompts (the adaptive policy
trims the later positions, which are rarely accepted here, but not for free).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import sys
import tempfile
import time

import torch

from pyengine import LLM, SamplingParams
from pyengine.engine.llm_engine import LLMEngine
from pyengine.loader import default_model_path
from pyengine.spec_decode.config import SpeculativeConfig

from layer_skip_draft import write_layer_skip_draft  # noqa: E402  (benchmarks/ is on sys.path)

CODE = '''def mean(values):
    total = 0
    for v in values:
        total = total + v
    return total / len(values)


def variance(values):
    m = mean(values)
    total = 0
    for v in values:
        total = total + (v - m) * (v - m)
    return total / len(values)
'''
PASSAGE = ("The lighthouse on Gull Rock was built in 1874 by the harbour board. Its keeper, Ada Morrow, "
           "kept a log of every ship that passed for thirty-one years. In 1905 a storm destroyed the lower "
           "gallery, and the light was rebuilt with a steel frame. The log books are now kept in the town "
           "museum, where visitors can read the entry for the night of the storm.")
GROUNDED = [
    f"Here is some Python code:\n\n{CODE}\nRewrite this code exactly, but rename the variable `total` to `acc`. "
    "Output only the code.",
    f"Copy the following paragraph, replacing the word 'log' with 'diary' everywhere:\n\n{PASSAGE}",
    f"{PASSAGE}\n\nQuote, word for word, the sentences of the passage that mention a year.",
]
OPEN = ["Write a short story about a dragon who learns to cook.", "What are the benefits of regular exercise?",
        "Describe a sunset over the ocean to someone who has never seen one."]


def run(llm: LLM, spec: SpeculativeConfig | None, prompts: list[str], batch: int, max_tokens: int,
        repeats: int = 1) -> dict:
    """Best of `repeats` runs (interference on a shared machine only ever slows a run down)."""
    return run_methods(llm, {"m": spec}, prompts, batch, max_tokens, repeats)["m"]


def run_methods(llm: LLM, methods: dict[str, SpeculativeConfig | None], prompts: list[str], batch: int,
                max_tokens: int, repeats: int = 1) -> dict[str, dict]:
    """Best of `repeats` runs per method, the methods taking turns (plain, ngram, plain, ngram, ...)
    so that a burst of interference cannot land on all the runs of one method."""
    results: dict[str, list[dict]] = {name: [] for name in methods}
    for _ in range(repeats):
        for name, spec in methods.items():
            results[name].append(run_once(llm, spec, prompts, batch, max_tokens))
    return {name: max(rs, key=lambda r: r["tokens_per_s"]) for name, rs in results.items()}


def prompt_batches(prompts: list[str], batch: int) -> list[list[str]]:
    """Batches of `batch` prompts that use every prompt at least once: batch 1 runs each prompt
    alone in turn; larger batches cycle through the prompts."""
    num_batches = -(-len(prompts) // batch)
    return [[prompts[(b * batch + i) % len(prompts)] for i in range(batch)] for b in range(num_batches)]


def run_once(llm: LLM, spec: SpeculativeConfig | None, prompts: list[str], batch: int, max_tokens: int) -> dict:
    base = llm.engine
    llm.engine = LLMEngine(base.runner, base.model_config, base.tokenizer, dataclasses.replace(base.cfg, speculative=spec))
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = []
    t0 = time.perf_counter()
    for texts in prompt_batches(prompts, batch):  # one engine serves them in turn, as a server would
        outs += llm.chat([[{"role": "user", "content": t}] for t in texts], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    stats = llm.stats()
    llm.engine = base
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"tokens_per_s": round(generated / wall, 2), "wall_s": round(wall, 3), "generated_tokens": generated,
            "mean_acceptance_length": round(stats.get("mean_acceptance_length", 1.0), 3),
            "acceptance_rate": round(stats.get("acceptance_rate", 0.0), 3),
            "outputs": [o.outputs[0].token_ids for o in outs]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--num-spec-tokens", type=int, default=4)
    ap.add_argument("--draft-model", help="a draft model (same tokenizer); omitted: draft-model rows are skipped")
    ap.add_argument("--draft-layers", type=int,
                    help="no draft model given: use the target's first N blocks as one (layer_skip_draft.py)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--repeats", type=int, default=3, help="best of this many runs per cell")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    llm = LLM(device="cpu", max_model_len=2048, max_num_seqs=max(args.batch_sizes))
    draft_note = args.draft_model or "none given: no draft model smaller than SmolLM2-135M ships here"
    if args.draft_layers and not args.draft_model:
        args.draft_model = os.path.join(tempfile.mkdtemp(), "layer_skip_draft.gguf")
        write_layer_skip_draft(default_model_path(), args.draft_model, args.draft_layers)
        draft_note = (f"layer-skip draft: the target's first {args.draft_layers} blocks with its embedding, final "
                      "norm and head (benchmarks/layer_skip_draft.py)")
    methods: dict[str, SpeculativeConfig | None] = {
        "plain": None,
        "ngram": SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": args.num_spec_tokens,
                                              "prompt_lookup_min": 2, "prompt_lookup_max": 4}),
    }
    if args.draft_model:
        methods["draft"] = SpeculativeConfig.from_dict({"model": args.draft_model,
                                                        "num_speculative_tokens": args.num_spec_tokens})
    run(llm, None, OPEN, 1, 8)  # warm-up
    results: dict[str, dict] = {}
    for kind, prompts in (("grounded", GROUNDED), ("open", OPEN)):
        for batch in args.batch_sizes:
            row = run_methods(llm, methods, prompts, batch, args.max_tokens, args.repeats)
            plain, reference = row["plain"], row["plain"]["outputs"]
            for r in row.values():
                r["speedup"] = round(r["tokens_per_s"] / plain["tokens_per_s"], 3)
                r["identical_to_plain"] = r.pop("outputs") == reference  # greedy: must hold
            results[f"{kind}_batch_{batch}"] = row
            print(f"{kind} batch {batch}: " + ", ".join(f"{n} {r['tokens_per_s']} tok/s x{r['speedup']}"
                                                        for n, r in row.items()), file=sys.stderr)
    print(json.dumps({
        "benchmark": "spec", "model": "SmolLM2-135M-Instruct Q4_1 (fp32 on CPU)", "max_tokens": args.max_tokens,
        "num_spec_tokens": args.num_spec_tokens, "threads": torch.get_num_threads(), "repeats": args.repeats,
        "tokens_per_s": "generated tokens / wall time of the generate calls (prefill included), best of repeats "
                        "(methods take turns); a batch smaller than the prompt set runs batches in turn on one "
                        "engine, so batch 1 covers each prompt alone",
        "machine": f"{platform.machine()}, {os.cpu_count()} cpus", "date": datetime.date.today().isoformat(),
        "command": "python " + " ".join(sys.argv), "results": results,
        "draft_model": draft_note,
    }, indent=1))


if __name__ == "__main__":
    main()
