"""What a verify row costs on the CPU: the default model (SmolLM2 GGUF, the int16-limb linears) timed
on one request at context ~300, a step of q = 1..5 tokens (one decode row, or a verify row of q - 1
drafts): the layers and the logits apart; and layer 0's linears alone at M = 1..8 rows. Speculation
pays on the CPU only if a draft's row costs well under a decode step (docs/speculation.md).
Prints JSON.

    python benchmarks/cpu_verify_rows.py [--repeats 20] [--isa amx|avx512|avx2] [--out FILE]
                                         [--eagle3 HEAD_DIR]

--eagle3 also times the head's forward with its logits (what a catch-up or a chained draft costs)
at 1 / 5 / 32 tokens, its linears rounded to Q8_0 (KernelConfig.cpu_q8_draft_head) and dense.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.bench_load import loadavg, machine  # noqa: E402
from pyengine import LLM, SamplingParams  # noqa: E402
from pyengine.loader import default_model_path  # noqa: E402
from pyengine.engine.attention_metadata import AttentionMetadata  # noqa: E402


def timed(f, repeats: int) -> float:
    """Best of 3 means of `repeats` calls, in ms."""
    f()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(repeats):
            f()
        best = min(best, (time.perf_counter() - start) / repeats)
    return round(1e3 * best, 3)


def head_forward_ms(args, q8: bool) -> dict:
    """The EAGLE-3 head's forward + logits (MtpProposer._forward) over T tokens of one row at
    positions 300.., with random aux states, in ms; and the bytes its linears stream."""
    from pyengine.spec_decode.head_graphs import HeadFeed
    from pyengine.spec_decode.step_cost import weight_footprint

    llm = LLM(args.gguf or default_model_path(), device="cpu", kernel_config={"cpu_qdot_isa": args.isa,
                                                                         "cpu_q8_draft_head": q8},
              speculative_config={"method": "eagle3", "model": args.eagle3, "num_speculative_tokens": 4})
    runner, proposer = llm.engine.runner, llm.engine.proposer
    table = np.arange(64, dtype=np.int32)[None, :]
    out = {"weight_bytes": weight_footprint(proposer.layer)[1]}
    with runner.step_threads(), torch.inference_mode():
        for t in (1, 5, 32):
            feed = HeadFeed.build(table, np.array([300]), np.array([t]), runner.block_size, np.full(t, 200, np.int64))
            aux = torch.randn(t, len(proposer.layer.aux_layers) * runner.config.hidden_size)
            out[f"forward_ms_{t}"] = timed(lambda: proposer._forward(feed, proposer.target_hidden(aux), np.array([0])),
                                           args.repeats)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", default=None)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out")
    ap.add_argument("--isa", default="amx", choices=["amx", "avx512", "avx2"],
                    help="the best kernels the int16-limb linears may run (KernelConfig.cpu_qdot_isa)")
    ap.add_argument("--eagle3", help="an EAGLE-3 head directory: time its forwards too")
    args = ap.parse_args()
    llm = LLM(args.gguf or default_model_path(), device="cpu", kernel_config={"cpu_qdot_isa": args.isa})
    eng, runner = llm.engine, llm.engine.runner
    eng.add_request(list(range(100, 400)), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    for _ in range(3):
        eng.step()
    batch = eng.scheduler.schedule()  # one decode row; its table holds the context's blocks
    table = torch.as_tensor(np.asarray(batch.block_tables), dtype=torch.int32)
    B, last = runner.block_size, int(batch.context_lens[0]) - 1

    def step_inputs(q: int):
        # q tokens ending at the row's last position: their KV slots are the row's own
        pos = torch.arange(last + 1 - q, last + 1)
        meta = AttentionMetadata(slot_mapping=table[0].long()[pos // B] * B + pos % B, block_tables=table,
                                 query_start_loc=torch.tensor([0, q], dtype=torch.int32),
                                 context_lens=torch.tensor([last + 1], dtype=torch.int32), max_query_len=q,
                                 max_context_len=last + 1, block_size=B)
        return torch.full((q,), 200, dtype=torch.long), pos, meta

    isa = runner.model.layers[0].qkv_proj.isa  # the linears' kernels: "amx", "avx512" (VNNI) or "avx2"
    result = dict(machine(), command="python " + " ".join(sys.argv), context=last + 1, isa=isa, steps=[], linears={})
    layer0 = runner.model.layers[0]
    with runner.step_threads(), torch.inference_mode():
        for q in range(1, 6):
            ids, pos, meta = step_inputs(q)
            hidden = runner.model(ids, pos, meta, runner.kv_caches)
            result["steps"].append({
                "q": q,
                "layers_ms": timed(lambda: runner.model(ids, pos, meta, runner.kv_caches), args.repeats),
                "logits_ms": timed(lambda: runner.model.compute_logits(hidden), args.repeats)})
        for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            lin = getattr(layer0, name, None)
            if lin is None:
                continue
            k = int(getattr(lin, "in_features", 0) or (1536 if name == "down_proj" else 576))
            result["linears"][name] = {m: timed(lambda x=torch.randn(m, k): lin(x), 50 * args.repeats)
                                       for m in (1, 2, 3, 4, 5, 8)}
    if args.eagle3:
        result["eagle3_head"] = {name: head_forward_ms(args, q8) for name, q8 in (("q8", True), ("dense", False))}
    result["loadavg"] = loadavg()
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
