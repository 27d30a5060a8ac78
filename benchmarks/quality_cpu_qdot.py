"""How far the CPU's integer-dot GGUF linears (csrc/cpu/cpu_gemm_qdot.h: two int16 limbs and int8,
llama.cpp's arithmetic; both opt-in) move the default model's logits from the fp32 products of its
dequantised weights, with llama.cpp as the yardstick.

Sequences: chat prompts from Spec-Bench's questions (one per category) followed by the fp32
reference's own greedy answer, teacher-forced, so every position is a real context. Per position
the logits of: `fp32` (pyengine, weights dequantised to fp32, exact products: the default),
`int16` (pyengine from the file's codes, KernelConfig.cpu_int16_dot), `int8` (from the codes,
cpu_int8_dot), `llama.cpp` (llama-cpp-python, logits_all).
Reported per pair: max and mean absolute difference and top-1 agreement.

    python benchmarks/quality_cpu_qdot.py [--prompts ../shared/data/spec_bench_questions.jsonl]
        [--per-category 1] [--answer-tokens 64] [--out benchmarks/results/cpu_qdot_quality.json]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_load import loadavg, machine  # noqa: E402


def load(path: str, from_codes: bool):
    from pyengine.loader.gguf_file import load_gguf

    model, config, tokenizer = load_gguf(path, torch.float32, prepack_cpu=True, from_codes=from_codes)
    model.prepack_for_cpu()
    return model, config, tokenizer


@torch.inference_mode()
def all_logits(model, config, ids: list[int]) -> torch.Tensor:
    """Logits of every position of ids, one prefill (the rows' bits do not depend on it)."""
    from tests.utils_paged import PagedCache, make_meta

    cache = PagedCache(config, len(ids) // 16 + 2, 16, torch.float32)
    table: list[int] = []
    cache.grow(table, len(ids))
    meta, positions = make_meta([(table, 0, len(ids))], 16)
    hidden = model(torch.tensor(ids, dtype=torch.int64), positions, meta, cache.kv_caches)
    return model.compute_logits(hidden).float()


def compare(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    diff = (a - b).abs()
    return {"max_abs": round(float(diff.max()), 4), "mean_abs": round(float(diff.mean()), 5),
            "top1_agree": round(float((a.argmax(-1) == b.argmax(-1)).float().mean()), 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", default=os.path.join(ROOT, "..", "shared", "data", "spec_bench_questions.jsonl"))
    ap.add_argument("--per-category", type=int, default=1)
    ap.add_argument("--answer-tokens", type=int, default=64)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "cpu_qdot_quality.json"))
    args = ap.parse_args()
    from tests.utils_paged import greedy_generate

    from pyengine.loader import default_model_path

    path = default_model_path()
    ref, config, tok = load(path, from_codes=False)
    from pyengine.ops.kernel_config import KernelConfig, use_kernel_config

    with use_kernel_config(KernelConfig(cpu_int8_dot=True)):  # llama.cpp's arithmetic (opt-in)
        new = load(path, from_codes=True)[0]
    with use_kernel_config(KernelConfig(cpu_int8_dot=False, cpu_int16_dot=True)):  # two int16 limbs
        limbs = load(path, from_codes=True)[0]
    if not all(getattr(layer.qkv_proj, "int8_dot", False) for layer in new.layers) or \
            not all(getattr(layer.qkv_proj, "int16_dot", False) for layer in limbs.layers):
        raise SystemExit("this CPU does not run the integer-dot linears (AVX2 + F16C)")
    seen: dict[str, int] = {}
    questions = []
    with open(args.prompts, encoding="utf-8") as f:
        for line in f:
            q = json.loads(line)
            if seen.get(q["category"], 0) < args.per_category:
                seen[q["category"]] = seen.get(q["category"], 0) + 1
                questions.append(q["turns"][0])
    sequences = []
    for text in questions:
        prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]), add_special_tokens=False)
        answer = greedy_generate(ref, config, [prompt], args.answer_tokens)[0][0]
        sequences.append(prompt + answer)
    logits = {"fp32": [], "int16": [], "int8": [], "llama.cpp": []}
    try:
        from llama_cpp import Llama
    except ImportError:
        Llama = None
    cpp = Llama(model_path=path, n_ctx=2048, logits_all=True, verbose=False) if Llama else None
    for ids in sequences:
        logits["fp32"].append(all_logits(ref, config, ids))
        logits["int8"].append(all_logits(new, config, ids))
        logits["int16"].append(all_logits(limbs, config, ids))
        if cpp is not None:
            cpp.reset()
            cpp.eval(ids)
            logits["llama.cpp"].append(torch.from_numpy(np.array(cpp.scores[:len(ids)], dtype=np.float32)))
    cat = {k: torch.cat(v) for k, v in logits.items() if v}
    pairs = [("int16", "fp32"), ("int8", "fp32"), ("llama.cpp", "fp32"), ("int8", "llama.cpp"), ("int16", "llama.cpp")]
    result = {
        "benchmark": "default model's logits: integer-dot GGUF linears (int16 limbs, int8) vs fp32 products of "
                     "the dequantised weights",
        "machine": machine(), "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "command": "python benchmarks/quality_cpu_qdot.py " + " ".join(sys.argv[1:]), "loadavg": loadavg(),
        "sequences": len(sequences), "positions": int(cat["fp32"].shape[0]),
        "comparisons": {f"{a} vs {b}": compare(cat[a], cat[b]) for a, b in pairs if a in cat and b in cat},
    }
    print(json.dumps(result, indent=1))
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
