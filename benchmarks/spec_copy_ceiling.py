"""The most that any copying proposer (ngram, suffix decoding) could gain on Spec-Bench: an oracle
that, at each step, drafts the longest continuation of the true greedy output that follows an
occurrence of the context's last m tokens (--min-match) in what a copying proposer can see (the
request's prompt and output so far and, generously, every other request's whole output) and has
every draft accepted. Each step then yields its drafts plus
the verify's own token, so tokens per step under the oracle bound the speedup of every copying
method: no drafting step costs less than a plain one (a verify replay of q tokens takes at least
a decode replay's time, benchmarks/results/spec_bench_h100.json replay_ms_by_q), hence speedup =
plain steps x plain step / sum of spec steps <= plain steps / spec steps.

Beside the oracles, the proposers themselves on the same outputs, every step drafting up to k (no
draft-length policy, no costs): the ngram lookup from min_n matched tokens, the suffix tree, and
the device loop's mix (engine/device_verify.py: the suffix tree's prediction after a step that
accepted every draft, the lookup otherwise).

Greedy outputs come from plain decoding on --device (the CPU's int16-limb numerics by default; the
H100's bf16 outputs differ in places). Per category: tokens per step of the
oracle with drafts capped at k (4, 8, 16) and uncapped, and the fraction of output tokens that sit
in a copied run.

    python benchmarks/spec_copy_ceiling.py --prompts ../shared/data/spec_bench_questions.jsonl \
        --per-category 8 --max-tokens 256 --out benchmarks/results/spec_copy_ceiling_cpu.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(__file__))
from bench_spec_gpu import spec_bench_rows  # noqa: E402

import numpy as np  # noqa: E402

from pyengine import LLM, SamplingParams, _C  # noqa: E402
from pyengine.loader import default_model_path  # noqa: E402

CAPS = (4, 8, 16, None)


def longest_copy(out: list[int], p: int, key: tuple[int, ...], corpus: list[list[int]],
                 starts: dict[tuple[int, ...], list[tuple[int, int]]]) -> int:
    """Length of the longest prefix of out[p:] that follows an occurrence of `key` (the context's
    last min_match tokens) in a corpus sequence (starts: min_match tokens -> (sequence, position
    after them) of every occurrence). The request's own output counts up to p only."""
    best = 0
    for s, j in starts.get(key, ()):
        seq = corpus[s]
        limit = len(seq) if s != 1 else p  # corpus[1] is the request's own output: what is generated
        n = 0
        while p + n < len(out) and j + n < limit and seq[j + n] == out[p + n]:
            n += 1
        best = max(best, n)
    return best


def oracle_steps(prompt: list[int], out: list[int], others: list[list[int]], cap: int | None,
                 min_match: int) -> tuple[int, int]:
    """(steps, tokens drafted and accepted) of the oracle over one request's output."""
    corpus = [prompt, out] + others
    starts: dict[tuple[int, ...], list[tuple[int, int]]] = defaultdict(list)
    for s, seq in enumerate(corpus):
        for j in range(min_match, len(seq)):
            starts[tuple(seq[j - min_match:j])].append((s, j))
    p = steps = copied = 0
    while p < len(out):
        key = tuple((prompt[-min_match:] + out[max(p - min_match, 0):p])[-min_match:])  # the context's last tokens
        n = longest_copy(out, p, key, corpus, starts) if len(key) == min_match else 0
        n = min(n, len(out) - p - 1)  # the last token comes from a verify step's own sample
        if cap is not None:
            n = min(n, cap)
        steps += 1
        copied += n
        p += n + 1
    return steps, copied


def proposer_steps(prompts: list[list[int]], outputs: list[list[int]], kind: str, k: int, min_n: int = 1) -> list[int]:
    """Steps per request when every step drafts up to k tokens with proposer `kind` ("ngram",
    "suffix" or "loop"), requests one after another (the suffix cache holds the earlier ones)."""
    suffix = _C.SuffixProposer()
    steps_of = []
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        p = steps = 0
        predicted: list[int] | None = None
        while p < len(out):
            ctx = prompt + out[:p]
            if kind == "suffix":
                drafts = suffix.propose_tokens(i, ctx, k, len(prompt))
            elif kind == "loop" and predicted is not None:
                drafts = predicted
            else:
                drafts = _C.propose_ngram(np.asarray(ctx, dtype=np.int32), min_n, 4, k)
            a = 0
            while a < len(drafts) and p + a < len(out) - 1 and drafts[a] == out[p + a]:
                a += 1
            predicted = None
            if kind == "loop" and drafts and a == len(drafts):  # the tree's prediction for the next step
                nxt = suffix.propose_tokens(i, ctx + list(drafts), k + 1, len(prompt))
                if nxt and nxt[0] == out[p + a]:
                    predicted = nxt[1:]
            p += a + 1
            steps += 1
        suffix.forget(i, True)
        steps_of.append(steps)
    return steps_of


def greedy_outputs(args) -> tuple[list[dict], list[list[int]], list[list[int]], str]:
    """The Spec-Bench rows and their prompts' and greedy outputs' token ids (from --tokens if that
    file exists; written there otherwise)."""
    rows = spec_bench_rows(args.prompts, args.per_category)
    if args.tokens and os.path.exists(args.tokens):
        with open(args.tokens) as f:
            saved = json.load(f)
        return rows, saved["prompts"], saved["outputs"], saved["model"]
    gguf = args.gguf or default_model_path()
    llm = LLM(gguf, device=args.device, max_num_seqs=args.batch, max_model_len=2048)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    outs = llm.chat([[{"role": "user", "content": r["turns"][0]}] for r in rows], params, use_tqdm=False)
    prompts = [list(o.prompt_token_ids) for o in outs]
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    if args.tokens:
        with open(args.tokens, "w") as f:
            json.dump({"model": os.path.basename(gguf), "prompts": prompts, "outputs": tokens}, f)
    return rows, prompts, tokens, os.path.basename(gguf)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", required=True, help="Spec-Bench jsonl (turns[0] of each line)")
    ap.add_argument("--gguf", default=None, help="model (default: the embedded SmolLM2 GGUF)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--per-category", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--tokens", default=None, help="cache of the greedy outputs (json): read if present, else written")
    ap.add_argument("--min-match", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows, prompts, tokens, model = greedy_outputs(args)
    categories = sorted({r["category"] for r in rows})
    result = {"device": args.device, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": "python " + " ".join(sys.argv), "model": model,
              "num_prompts": len(rows), "max_tokens": args.max_tokens, "by_min_match": {}}
    for mm in args.min_match:
        agg = {c: {"tokens": 0, "copied": 0, **{f"steps_k{k}": 0 for k in CAPS}} for c in categories + ["overall"]}
        for i, r in enumerate(rows):
            others = tokens[:i] + tokens[i + 1:]
            for c in (r["category"], "overall"):
                agg[c]["tokens"] += len(tokens[i])
            for cap in CAPS:
                steps, copied = oracle_steps(prompts[i], tokens[i], others, cap, mm)
                for c in (r["category"], "overall"):
                    agg[c][f"steps_k{cap}"] += steps
                    if cap is None:
                        agg[c]["copied"] += copied
        result["by_min_match"][str(mm)] = {
            c: {**{f"tokens_per_step_k{k or 'unbounded'}": round(a["tokens"] / max(a[f"steps_k{k}"], 1), 3) for k in CAPS},
                "copied_fraction": round(a["copied"] / max(a["tokens"], 1), 3), "tokens": a["tokens"]}
            for c, a in agg.items()}
    result["proposers"] = {}
    for kind, min_n in (("ngram", 2), ("ngram", 1), ("suffix", 1), ("loop", 2), ("loop", 1)):
        for k in (4, 16):
            name = f"{kind}_k{k}" + (f"_min{min_n}" if kind != "suffix" else "")
            steps = proposer_steps(prompts, tokens, kind, k, min_n)
            table = {}
            for c in categories + ["overall"]:
                idx = [i for i, r in enumerate(rows) if c in (r["category"], "overall")]
                table[c] = round(sum(len(tokens[i]) for i in idx) / max(sum(steps[i] for i in idx), 1), 3)
            result["proposers"][name] = table
    text = json.dumps(result, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    for name, table in result["proposers"].items():
        print(f"{name:16s} " + " ".join(f"{c} {x}" for c, x in table.items()))
    for mm, table in result["by_min_match"].items():
        print(f"min_match {mm}:")
        for c, v in table.items():
            print(f"  {c:15s} " + " ".join(f"{k.removeprefix('tokens_per_step_')} {x}" for k, x in v.items()))


if __name__ == "__main__":
    main()
