"""`python -m pyengine.check`: is speculative decoding (and batching) lossless on these prompts?

Runs the prompts greedily plain (batched), speculative (batched) and plain one at a time, and
reports per row: identical bits, or the first divergence with its top-2 gap and the largest logit
difference (pyengine/check_rows.py explains the statuses and the tie bound). Exit 0 when every row is
identical, differs only in logit bits or diverges at a tie within the final rounding (with
--strict: only when every row is bit-identical); exit 1 otherwise; exit 2 with one error line on
bad input.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from pyengine.entrypoints.cli_args import OneLineParser, add_engine_args, engine_kwargs, fail
from pyengine.entrypoints.generate import load_prompts_file


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = OneLineParser(prog="python -m pyengine.check", description=__doc__.splitlines()[0])
    add_engine_args(p, default_spec="ngram")
    p.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    p.add_argument("--prompts-file",
                   help='one prompt per line, or .jsonl with a "prompt" or "turns" field (the first turn)')
    p.add_argument("--num-prompts", type=int, help="the first N prompts only")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                   help="render prompts with the model's chat template (default on)")
    p.add_argument("--alone", action=argparse.BooleanOptionalAction, default=True,
                   help="also compare each prompt run alone with the batched run (default on)")
    p.add_argument("--strict", action=argparse.BooleanOptionalAction, default=None,
                   help="fail on any bit difference in the logits (default: on with --batch-invariant)")
    p.add_argument("--json", action="store_true", help="print the report as one JSON document")
    return p.parse_args(argv)


def read_prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompt or [])
    if args.prompts_file:
        try:
            prompts += load_prompts_file(args.prompts_file)
        except ValueError as e:
            fail(str(e))
    if not prompts:
        fail(f"--prompts-file {args.prompts_file} has no prompts" if args.prompts_file
             else "no prompts: give --prompt TEXT or --prompts-file FILE")
    if args.num_prompts is not None:
        if args.num_prompts < 1:
            fail(f"--num-prompts must be positive, got {args.num_prompts}")
        prompts = prompts[:args.num_prompts]
    for i, p in enumerate(prompts):
        if not p.strip():
            fail(f"prompt {i} is empty")
    return prompts


def _jsonable(x: Any) -> Any:
    if hasattr(x, "item"):  # numpy / torch scalars in engine stats
        return x.item()
    if hasattr(x, "tolist"):
        return x.tolist()
    raise TypeError(f"not JSON serialisable: {type(x).__name__}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    prompts = read_prompts(args)
    kwargs = engine_kwargs(args)
    spec = kwargs.pop("speculative_config")
    if args.max_tokens < 1:
        fail(f"--max-tokens must be positive, got {args.max_tokens}")
    for flag, path in (("model", args.model), ("draft model", args.draft_model)):
        if path and not os.path.exists(path):
            fail(f"{flag} file not found: {path}")
    from pyengine.spec_decode.config import SpeculativeConfig

    try:
        SpeculativeConfig.from_dict(spec)
    except ValueError as e:
        fail(str(e))
    from pyengine.check import check_losslessness  # heavy imports after the cheap checks

    try:
        report = check_losslessness(
            prompts, speculative_config=spec, max_tokens=args.max_tokens, alone=args.alone, chat=args.chat,
            strict=args.strict, log=lambda line: print(line, file=sys.stderr), **kwargs)
    except ValueError as e:
        fail(str(e).splitlines()[0])
    if args.json:
        print(json.dumps(report.to_dict(), default=_jsonable))
    else:
        print(report.format_table())
    return report.exit_code


if __name__ == "__main__":
    raise SystemExit(main())
