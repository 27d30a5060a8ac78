"""Replay time of every CUDA graph an LLM captures, on padding inputs (slot -1, context 0: no KV
read or written): decode / verify graphs (b, q) and prefill graphs (b, -t). What a step's replay
costs before any attention work, by rows and token slots (docs/speculation.md, batch 16).

    python3 benchmarks/graph_replay_costs.py --gguf S.gguf --batch 16 [--prefill-rows 16] [--min-rows 8]
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import pyengine.engine.prefill_graphs as prefill_graphs  # noqa: E402
from pyengine import LLM  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--batch", type=int, default=16, help="max_num_seqs: the largest graph bucket")
    ap.add_argument("--prefill-rows", type=int, default=None,
                    help="rows a prefill graph may hold (default: the engine's PREFILL_GRAPH_ROWS)")
    ap.add_argument("--min-rows", type=int, default=1, help="time only graphs of at least this many rows")
    ap.add_argument("--replays", type=int, default=10)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    if args.prefill_rows is not None:
        prefill_graphs.PREFILL_GRAPH_ROWS = args.prefill_rows
    llm = LLM(args.gguf, device="cuda", dtype="bfloat16", max_num_seqs=args.batch, max_model_len=2048,
              speculative_config={"method": "suffix", "num_speculative_tokens": 4})  # verify graphs up to q = 5
    g = llm.engine.runner.graph_runner
    g.capture_all()
    print(f"buckets {g.buckets}, prefill token buckets {g.prefill_buckets}, max q {g.max_q}")
    for key in sorted(g.graphs):
        graph = g.graphs[key][0]
        if graph is None or key[0] < args.min_rows:
            continue
        g._stage_padding(key)
        graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(args.replays):
            graph.replay()
        end.record()
        end.synchronize()
        print(f"{key}: {1e3 * start.elapsed_time(end) / args.replays:.0f} us")


if __name__ == "__main__":
    main()
