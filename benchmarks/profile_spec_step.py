"""cProfile of greedy speculative decoding on the GPU (SmolLM2, Spec-Bench prompts): where a step's
host time goes. Prints the top functions by own time and by cumulative time.

    python3 benchmarks/profile_spec_step.py --gguf PATH --prompts spec_bench.jsonl --batch 64 --method ngram
"""
from __future__ import annotations

import argparse
import cProfile
import json
import pstats

from pyengine import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--method", default="ngram", help="ngram, suffix, or none (plain)")
    ap.add_argument("--fixed", action="store_true", help="no adaptive draft length")
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()
    with open(args.prompts) as f:
        questions = [json.loads(line)["turns"][0] for line in f if line.strip()]
    spec = None if args.method == "none" else {"method": args.method, "num_speculative_tokens": 4,
                                               "adaptive_draft_length": not args.fixed}
    llm = LLM(args.gguf, device="cuda", dtype="bfloat16", max_num_seqs=args.batch, max_model_len=2048,
              speculative_config=spec)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    conv = [[{"role": "user", "content": q}] for q in questions]
    llm.chat(conv[-args.batch:], params, use_tqdm=False)  # warm-up on other prompts: graphs captured
    prof = cProfile.Profile()
    prof.enable()
    llm.chat(conv[:args.batch], params, use_tqdm=False)
    prof.disable()
    st = llm.stats()
    print({k: st[k] for k in ("num_steps", "acceptance_rate") if k in st})
    p = pstats.Stats(prof)
    p.sort_stats("tottime").print_stats(22)
    p.sort_stats("cumulative").print_stats(30)


if __name__ == "__main__":
    main()
