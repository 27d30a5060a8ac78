"""DeepSeek-V3 at real widths, few layers, random bf16 weights, on the GPU: decode step time and
bandwidth use at several batch sizes, and the cost of an MTP verify step (1 + k tokens per row)
against a decode step (1 token per row), measured in the same run.

Bytes a step must read: attention and dense weights, the shared expert, every routed expert that
at least one token of the step chose (counted from the router's own choices, per layer), the
embedding rows, lm_head, and the latent cache of every row (context x 576 x 2 bytes per layer).
Utilisation = those bytes / step time / the device copy bandwidth of the same run.

    python3 benchmarks/bench_deepseek_v3.py --moe-layers 2 --out benchmarks/results/deepseek_v3_h100.json

--batch-invariant also times each decode step under KernelConfig.batch_invariant (every GEMM one of
pyengine's invariant ones: the grouped expert and per-head GEMMs, the fp32 router; attention
without a key split) and reports its cost against the default step of the same run:

    python3 benchmarks/bench_deepseek_v3.py --moe-layers 2 --ks "" --batch-invariant
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.gpu_timing import copy_bandwidth_gbps, run_header, time_ms, time_ms_graph, write_result  # noqa: E402
from pyengine.engine.attention_metadata import AttentionMetadata  # noqa: E402
from pyengine.models.deepseek_v3 import DeepseekV3ForCausalLM, DeepseekV3ModelConfig  # noqa: E402
from pyengine.models.moe import MoE, MoEConfig, route  # noqa: E402
from pyengine.ops.kernel_config import use_kernel_config  # noqa: E402

DSV3 = dict(architecture="DeepseekV3ForCausalLM", vocab_size=129280, hidden_size=7168, intermediate_size=18432,
            num_attention_heads=128, num_key_value_heads=1, head_dim=192, rms_norm_eps=1e-6, rope_theta=10000.0,
            max_position_embeddings=16384, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
            qk_rope_head_dim=64, v_head_dim=128, first_k_dense_replace=1)


def build(moe_layers: int) -> DeepseekV3ForCausalLM:
    moe = MoEConfig(num_experts=256, top_k=8, n_group=8, topk_group=4, norm_topk_prob=True, routed_scaling_factor=2.5,
                    n_shared_experts=1, moe_intermediate_size=2048)
    cfg = DeepseekV3ModelConfig(**DSV3, num_hidden_layers=1 + moe_layers, moe=moe)
    with torch.device("cuda"):
        model = DeepseekV3ForCausalLM(cfg, torch.bfloat16)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith(("layernorm", "norm")) or "norm" in name.split(".")[-1]:
                p.fill_(1.0)
            elif p.is_floating_point() and p.dim() >= 1 and "cos" not in name and "sin" not in name:
                p.normal_(0.0, 0.02)
    return model.eval()


def step_inputs(batch: int, context: int, q_len: int, vocab: int = DSV3["vocab_size"], block_size: int = 64) -> tuple:
    """Rows of q_len new tokens at the end of `context` tokens, each with its own blocks."""
    blocks = -(-(context + q_len) // block_size)
    tables = torch.arange(batch * blocks, dtype=torch.int32, device="cuda").view(batch, blocks)
    pos = torch.arange(context, context + q_len, device="cuda").repeat(batch)
    rows = torch.arange(batch, device="cuda").repeat_interleave(q_len)
    slots = tables[rows, (pos // block_size)].long() * block_size + pos % block_size
    meta = AttentionMetadata(slot_mapping=slots, block_tables=tables,
                             query_start_loc=torch.arange(0, batch * q_len + 1, q_len, dtype=torch.int32, device="cuda"),
                             context_lens=torch.full((batch,), context + q_len, dtype=torch.int32, device="cuda"),
                             max_query_len=q_len, max_context_len=context + q_len, block_size=block_size)
    ids = torch.randint(0, vocab, (batch * q_len,), device="cuda")
    return ids, pos, meta, batch * blocks


def record_step(row: dict, k: int, batch: int, ms: float, graph_ms: float, **extra) -> None:
    """A step's eager and graph-replayed times into row: "decode" (k = 0, with tokens/s) or
    "verify_k{k}" (with its cost relative to the row's decode step)."""
    entry = {"step_ms": round(ms, 3), "graph_step_ms": round(graph_ms, 3), **extra}
    if k == 0:
        entry["tokens_per_s"] = round(batch / (ms * 1e-3), 1)
        entry["graph_tokens_per_s"] = round(batch / (graph_ms * 1e-3), 1)
        row["decode"] = entry
    else:
        entry["vs_decode"] = round(ms / row["decode"]["step_ms"], 3)
        entry["graph_vs_decode"] = round(graph_ms / row["decode"]["graph_step_ms"], 3)
        row[f"verify_k{k}"] = entry


def experts_hit(model: DeepseekV3ForCausalLM, ids, pos, meta, caches) -> list[int]:
    """Distinct routed experts each MoE layer's router picks for this step's tokens."""
    hits: list[int] = []

    def hook(module: MoE, args):
        x = args[0]
        chosen, _ = route(x.float() @ module.gate, module.e_score_correction_bias, module.cfg)
        hits.append(int(chosen.unique().numel()))

    handles = [m.register_forward_pre_hook(hook) for m in model.modules() if isinstance(m, MoE)]
    model(ids, pos, meta, caches)
    for h in handles:
        h.remove()
    return hits


def weight_bytes(model: DeepseekV3ForCausalLM, hits: list[int]) -> int:
    total = 0
    for name, p in list(model.named_parameters()) + list(model.named_buffers()):
        if name.endswith(("w_gate_up", "w_down")) or name.startswith(("embed_tokens", "rope")):
            continue  # routed experts: counted per hit below; embedding: only the step's rows
        total += p.numel() * p.element_size()
    moe = next(m for m in model.modules() if isinstance(m, MoE))
    expert = (moe.w_gate_up[0].numel() + moe.w_down[0].numel()) * moe.w_down.element_size()
    return total + sum(hits) * expert


def time_invariant(step, ms: float, graph_ms: float) -> dict:
    """The step under KernelConfig.batch_invariant (kernels are chosen at capture, so the graph
    replays the invariant ones), eager and graph-replayed, and its cost against the default step."""
    with use_kernel_config(batch_invariant=True), torch.inference_mode():
        inv_ms = time_ms(step, reps=10)
        inv_graph_ms = time_ms_graph(step, inner=5, reps=5)
    return {"step_ms": round(inv_ms, 3), "graph_step_ms": round(inv_graph_ms, 3), "vs_default": round(inv_ms / ms, 3),
            "graph_vs_default": round(inv_graph_ms / graph_ms, 3)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--moe-layers", type=int, default=2, help="MoE layers after the dense one (3, the issue's shape, needs an H200: ~73 GB of weights)")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--ks", default="1,2,3")
    ap.add_argument("--batch-invariant", action="store_true",
                    help="also time decode steps under KernelConfig.batch_invariant, against the default")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    copy = copy_bandwidth_gbps()
    model = build(args.moe_layers)
    cfg = model.config
    result = dict(run_header(), copy_bandwidth_gbps=copy, model=dict(DSV3, num_hidden_layers=cfg.num_hidden_layers,
                  n_routed_experts=256, num_experts_per_tok=8, moe_intermediate_size=2048, n_shared_experts=1),
                  context=args.context, batch_invariant_compared=args.batch_invariant, rows=[])
    for batch in [int(b) for b in args.batches.split(",")]:
        row: dict = {"batch": batch}
        for k in [0] + [int(k) for k in args.ks.split(",") if k]:
            ids, pos, meta, blocks = step_inputs(batch, args.context, 1 + k)
            caches = model.make_kv_caches(blocks, 64, torch.device("cuda"))
            for c in caches:
                c.normal_(0.0, 1.0)
            with torch.inference_mode():
                hits = experts_hit(model, ids, pos, meta, caches)
                step = lambda: model.compute_logits(model(ids, pos, meta, caches)[-batch:])  # noqa: E731
                ms = time_ms(step, reps=10)
                graph_ms = time_ms_graph(step, inner=5, reps=5)  # what the engine's CUDA graphs replay
            kv = cfg.num_hidden_layers * batch * (args.context + 1 + k) * 576 * 2
            nbytes = weight_bytes(model, hits) + kv
            record_step(row, k, batch, ms, graph_ms, experts_hit_per_layer=hits, bytes_read=nbytes,
                        bandwidth_utilisation=round(nbytes / (ms * 1e-3) / (copy * 1e9), 3),
                        graph_bandwidth_utilisation=round(nbytes / (graph_ms * 1e-3) / (copy * 1e9), 3))
            if k == 0 and args.batch_invariant:
                row["decode_batch_invariant"] = time_invariant(step, ms, graph_ms)
            del caches
            torch.cuda.empty_cache()
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        write_result(args.out, result)


if __name__ == "__main__":
    main()
