"""Decode-step time of pyengine's model (paged cache, no C++ core) vs HF transformers generate.

usage: python benchmarks/profile_forward.py [--batch 1 16] [--context 100] [--steps 32] [--hf]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pyengine.loader import default_model_path, load_model  # noqa: E402
from tests.utils_paged import PagedCache, make_meta  # noqa: E402


@torch.inference_mode()
def time_decode(model, config, batch: int, context: int, steps: int, block_size: int = 16) -> float:
    """Seconds per decode step (forward + logits for every row) after a `context`-token prefill."""
    cache = PagedCache(config, batch * ((context + steps) // block_size + 2), block_size, torch.float32)
    tables: list[list[int]] = [[] for _ in range(batch)]
    for t in tables:
        cache.grow(t, context)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (batch * context,), generator=gen)
    meta, pos = make_meta([(t, 0, context) for t in tables], block_size)
    hidden = model(ids, pos, meta, cache.kv_caches)
    next_ids = model.compute_logits(hidden[meta.query_start_loc[1:].long() - 1]).argmax(-1)
    lengths = [context] * batch
    elapsed = 0.0
    for step in range(steps):
        for i, t in enumerate(tables):
            cache.grow(t, lengths[i] + 1)
        meta, pos = make_meta([(t, lengths[i], 1) for i, t in enumerate(tables)], block_size)
        start = time.perf_counter()
        hidden = model(next_ids, pos, meta, cache.kv_caches)
        next_ids = model.compute_logits(hidden).argmax(-1)
        if step >= 3:  # warm-up steps excluded
            elapsed += time.perf_counter() - start
        lengths = [n + 1 for n in lengths]
    return elapsed / (steps - 3)


def hf_tokens_per_s(batch: int, context: int, steps: int) -> float:
    import transformers

    folder, name = os.path.split(default_model_path())
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    ids = torch.randint(0, 49152, (batch, context), generator=torch.Generator().manual_seed(0))
    kwargs = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    def timed(new_tokens: int) -> float:
        start = time.perf_counter()
        hf.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs)
        return time.perf_counter() - start

    with torch.no_grad():
        timed(4)  # warm-up
        # decode-only rate: subtract a prefill-plus-one-token run
        return batch * (steps - 1) / (timed(steps) - timed(1))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--context", type=int, default=100)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--hf", action="store_true", help="also time HF transformers generate")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, config, _ = load_model(None, "cpu", torch.float32)
    for batch in args.batch:
        step = time_decode(model, config, batch, args.context, args.steps)
        line = f"batch {batch:3d}: pyengine decode step {step * 1e3:7.2f} ms = {batch / step:7.1f} tok/s"
        if args.hf:
            hf = hf_tokens_per_s(batch, args.context, args.steps)
            line += f" | HF generate decode {hf:7.1f} tok/s | ratio {batch / step / hf:5.2f}x"
        print(line, flush=True)


if __name__ == "__main__":
    main()
