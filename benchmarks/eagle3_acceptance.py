"""How well EAGLE-3 heads draft for the default model, measured on the CPU (acceptance does not need
a GPU): for each head, on the first turn of N Spec-Bench questions per category (chat template,
greedy, --max-tokens new tokens), the head's teacher-forced top-1 (its first step at every answer
position, from the target's aux states over prompt + answer: what scripts/train_eagle3.py reports
on held-out data) and the acceptance of drafting k = 1 and k = 3 with fixed lengths. Spec output is
checked equal to plain output. With --templated N the same is measured on N templated prompts the
training script never used (its own distribution), to tell a gap between distributions from one
between training and the engine's drafting.

    python benchmarks/eagle3_acceptance.py --heads pyengine/heads/smollm2-135m-instruct-eagle3 /tmp/old_head \
        --prompts ../shared/data/spec_bench_questions.jsonl --per-category 3 --out benchmarks/results/eagle3_acceptance_cpu.json
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
from typing import Any

import torch
from safetensors.torch import load_file

from pyengine import LLM, SamplingParams
from pyengine.models.eagle3_train import load_head

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def train_script() -> Any:
    spec = importlib.util.spec_from_file_location("train_eagle3", os.path.join(ROOT, "scripts", "train_eagle3.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def first_turns(path: str, per_category: int) -> list[str]:
    taken: dict[str, int] = {}
    texts = []
    with open(path) as f:
        for line in f:
            row = json.loads(line)
            if taken.get(row["category"], 0) < per_category:
                taken[row["category"]] = taken.get(row["category"], 0) + 1
                texts.append(row["turns"][0])
    return texts


@torch.inference_mode()
def teacher_forced_top1(head_dir: str, llm: LLM, seqs: list[list[int]], prompt_lens: list[int], aux: list[torch.Tensor]) -> float:
    model = llm.model
    head = load_head(head_dir, model.embed(torch.arange(model.config.vocab_size)).detach().float()).float()
    d2t = load_file(os.path.join(head_dir, "model.safetensors"))["d2t"]
    hits = total = 0
    for seq, n_prompt, a in zip(seqs, prompt_lens, aux):
        logits = head.unroll(torch.tensor(seq[1:] + [0])[None], a[None].float(), 1)[0][0]
        pred = logits.argmax(-1)
        ids = pred + d2t[pred]
        for i in range(n_prompt - 1, len(seq) - 2):  # step 0 at position i drafts token i + 2
            total += 1
            hits += int(ids[i].item() == seq[i + 2])
    return hits / max(total, 1)


def measure(llm: LLM, s: Any, texts: list[str], heads: list[str], max_tokens: int) -> list[dict[str, Any]]:
    """Each head's teacher-forced top-1 and fixed-k acceptance over `texts` (first turns)."""
    prompts = [s.encode_chat(llm.tokenizer, t) for t in texts]
    answers = s.generate_answers(llm, prompts, max_tokens)
    seqs = [pr + an for pr, an in zip(prompts, answers)]
    L = llm.model.config.num_hidden_layers
    aux = s.aux_states(llm.model, llm.engine.runner.build_metadata, seqs, (2, L // 2, L - 3), torch.device("cpu"), 4096)
    rows = []
    for head in heads:
        row: dict[str, Any] = {"head": head, "num_prompts": len(prompts),
                               "teacher_forced_top1": teacher_forced_top1(head, llm, seqs, [len(x) for x in prompts], aux)}
        for k in (1, 3):
            spec = LLM(device="cpu", speculative_config={"method": "eagle3", "model": head, "num_speculative_tokens": k,
                                                         "adaptive_draft_length": False})
            outs = spec.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
            if any(list(o.outputs[0].token_ids) != a for o, a in zip(outs, answers)):
                raise SystemExit(f"{head}: speculative output differs from plain output")
            st = spec.stats()
            row[f"k{k}"] = {"acceptance_rate": st["acceptance_rate"], "mean_acceptance_length": st["mean_acceptance_length"],
                            "per_position_acceptance": st["per_position_acceptance"]}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--heads", nargs="+", required=True)
    p.add_argument("--prompts", required=True, help="Spec-Bench questions (jsonl)")
    p.add_argument("--per-category", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--templated", type=int, default=0,
                   help="also measure N held-out templated prompts (those after the training run's --num-prompts)")
    p.add_argument("--train-prompts", type=int, default=6000, help="the training run's --num-prompts")
    p.add_argument("--out")
    args = p.parse_args()
    s = train_script()
    llm = LLM(device="cpu")
    rows = measure(llm, s, first_turns(args.prompts, args.per_category), args.heads, args.max_tokens)
    templated: list[dict[str, Any]] = []
    if args.templated:
        texts = s.make_prompts(len(s.TEMPLATES) * len(s.TOPICS) * len(s.STYLES), 0)
        templated = measure(llm, s, texts[args.train_prompts:args.train_prompts + args.templated], args.heads, args.max_tokens)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": platform.processor() or "cpu", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                       "command": "python benchmarks/eagle3_acceptance.py " + " ".join(os.sys.argv[1:]),
                       "max_tokens": args.max_tokens, "heads": rows, "templated_held_out": templated}, f, indent=1)


if __name__ == "__main__":
    main()
