"""What the command lines share: one-line errors (exit 2) and the engine's arguments, parsed once
into LLM(...) keyword arguments (generate, check and serve each add only their own flags)."""
from __future__ import annotations

import argparse
import sys
from typing import Any, NoReturn


def fail(message: str) -> NoReturn:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, exit 2 (argparse prints usage too)
        fail(message)


def add_engine_args(p: argparse.ArgumentParser, default_spec: str | None = None) -> None:
    """The model and engine flags every command takes (LLM's arguments, vLLM's names)."""
    p.add_argument("--model", help="HF model directory or .gguf file (default: SmolLM2-135M-Instruct)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default="auto", help="auto (fp32 on CPU, bf16 on GPU), float32, bfloat16, float16")
    p.add_argument("--spec", choices=["ngram", "suffix", "draft", "mtp", "eagle3"], default=default_spec,
                   help="speculative decoding method (suffix: suffix decoding over the request and recent ones; "
                        "mtp: the model's own multi-token-prediction layer; eagle3: an EAGLE-3 head, --draft-model DIR or the one shipped for the default model)")
    p.add_argument("--num-spec-tokens", type=int, default=4)
    p.add_argument("--draft-model", help="draft model path for --spec draft, EAGLE-3 head directory for --spec eagle3")
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--num-kv-blocks", type=int)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--num-state-checkpoints", type=int,
                   help="hybrid models: recurrent-state checkpoints for prefix caching (default: a tenth of the cache memory)")
    p.add_argument("--state-checkpoint-interval", type=int,
                   help="hybrid models: tokens between state checkpoints, a multiple of --block-size (default 256)")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (GPU)")
    p.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=None,
                   help="a row's numbers never depend on the rest of the batch (default: picked per model: on for "
                        "the CPU kernels and for fp16/bf16 Llama-family models on CUDA)")


def speculative_config(args: argparse.Namespace) -> dict[str, Any] | None:
    if args.spec is None:
        if args.draft_model:
            fail("--draft-model needs --spec draft or --spec eagle3")
        return None
    if args.spec == "draft":
        if not args.draft_model:
            fail("--spec draft needs --draft-model PATH")
        return {"model": args.draft_model, "num_speculative_tokens": args.num_spec_tokens}
    if args.spec == "eagle3":  # without --draft-model: the head shipped for the default model
        return {"method": "eagle3", "model": args.draft_model, "num_speculative_tokens": args.num_spec_tokens}
    if args.draft_model:
        fail(f"--draft-model is for --spec draft or eagle3, not --spec {args.spec}")
    return {"method": args.spec, "num_speculative_tokens": args.num_spec_tokens}


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """LLM(...) keyword arguments of add_engine_args' flags (the speculative config included)."""
    return dict(model=args.model, device=args.device, dtype=args.dtype, max_model_len=args.max_model_len,
                num_kv_blocks=args.num_kv_blocks, block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                speculative_config=speculative_config(args), enforce_eager=args.enforce_eager,
                batch_invariant=args.batch_invariant, enable_prefix_caching=args.enable_prefix_caching,
                num_state_checkpoints=args.num_state_checkpoints,
                state_checkpoint_interval=args.state_checkpoint_interval)
