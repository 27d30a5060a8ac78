"""A drafting head's catch-up deferred to the steps that draft (MtpProposer.lazy, spec_decode/
hidden_ring.py) against catching up every step, next to plain decoding: EAGLE-3 (the head shipped
for the default model, k = 4, adaptive draft lengths) at batch 1 on Spec-Bench prompts (N of each
category, chat template, greedy). The three run prompt by prompt in turn, so that a machine's
changing load touches each alike: decode tokens/s, head forwards, acceptance, and whether every
output equals plain decoding's.

    python benchmarks/bench_catch_up.py --gguf PATH --prompts spec_bench.jsonl --per-category 1 --device cpu
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

HEAD = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pyengine", "heads",
                    "smollm2-135m-instruct-eagle3")
MODES = ("plain", "deferred", "every_step")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--prompts", required=True, help="Spec-Bench jsonl (turns[0] of each line)")
    ap.add_argument("--per-category", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--head", default=HEAD)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    by_cat: dict[str, list[str]] = {}
    with open(args.prompts) as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                by_cat.setdefault(row.get("category", ""), []).append(row["turns"][0])
    questions = [q for qs in by_cat.values() for q in qs[:args.per_category]]
    cuda = args.device == "cuda"
    if cuda:
        header = run_header()
    else:
        from benchmarks.bench_load import loadavg, machine
        header = dict(machine(), device="cpu", date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                      command="python " + " ".join(sys.argv), torch=torch.__version__)
    kw = dict(device=args.device, max_num_seqs=1, dtype="bfloat16" if cuda else "auto")
    plain = LLM(args.gguf, **kw)
    spec = LLM(args.gguf, speculative_config={"method": "eagle3", "model": args.head, "num_speculative_tokens": 4}, **kw)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    seconds = dict.fromkeys(MODES, 0.0)
    forwards = dict.fromkeys(MODES[1:], 0)
    outputs: dict[str, list] = {m: [] for m in MODES}
    warm = [[{"role": "user", "content": "Hello"}]]
    for i, conv in enumerate([warm[0]] + [[{"role": "user", "content": q}] for q in questions]):
        for mode in MODES:
            llm = plain if mode == "plain" else spec
            if llm is spec:
                spec.engine.proposer.lazy = mode == "deferred"
            f0, d0 = spec.engine.proposer.num_forwards, llm.engine.decode_time
            out = llm.chat([conv], params, use_tqdm=False)[0].outputs[0].token_ids
            if i:  # the first conversation warms every path up
                seconds[mode] += llm.engine.decode_time - d0
                outputs[mode].append(list(out))
                if llm is spec:
                    forwards[mode] += spec.engine.proposer.num_forwards - f0
    tokens = args.max_tokens * len(questions)
    result = dict(header, prompts=len(questions), max_tokens=args.max_tokens,
                  decode_tokens_per_s={m: round(tokens / s, 1) for m, s in seconds.items()},
                  vs_plain={m: round(seconds["plain"] / s, 3) for m, s in seconds.items()},
                  head_forwards=forwards, acceptance_rate=spec.stats().get("acceptance_rate"),
                  identical_to_plain={m: outputs[m] == outputs["plain"] for m in MODES[1:]})
    if not cuda:
        result["loadavg_at_end"] = loadavg()
    print(json.dumps({k: v for k, v in result.items() if k != "command"}), flush=True)
    if args.out:
        write_result(args.out, result)


if __name__ == "__main__":
    main()
