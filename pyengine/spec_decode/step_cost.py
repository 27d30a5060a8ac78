"""The step-cost model of the draft-length policy: what a decode step that feeds n tokens costs.

Two forms. A line T(n) = a + b n (seconds; only b / a matters) modelled from the model's weights and
the device's rates, never timed: eager steps, where every token fed costs its matmuls. And, for
steps replayed from CUDA graphs, a table per batch bucket: the measured replay time of the bucket's
graph for each query length (every row is padded to the longest, so a step costs what its longest
row asks, whatever the other rows draft), plus the host time a step with drafts cannot hide
(little where the device loop builds it, more on the host's launch paths). The table is measured
once per bucket (CudaGraphRunner.measure_step_costs, at start-up) and fixed afterwards.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

StepCost = tuple[float, float]  # (a, b): a decode step that feeds n tokens costs a + b n (seconds)
# Only b / a matters to the policy. Without a model to derive it from: a bandwidth-bound step, a token
# fed costing 1% of the step's fixed cost.
DEFAULT_STEP_COST: StepCost = (1.0, 0.01)


def check_step_cost(value: Any, name: str = "step_cost") -> StepCost:
    """(a, b) as floats: a > 0 the fixed cost of a decode step, b >= 0 the cost of each token it
    feeds (any unit: only b / a matters). ValueError otherwise."""
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise ValueError(f"{name} must be a pair (a, b): a decode step feeding n tokens costs a + b * n, "
                         f"got {value!r}")
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        raise ValueError(f"{name} must hold two numbers, got {value!r}")
    a, b = float(value[0]), float(value[1])
    if not (math.isfinite(a) and math.isfinite(b) and a > 0.0 and b >= 0.0):
        raise ValueError(f"{name} needs a finite a > 0 (the step's fixed cost) and a finite b >= 0 (the cost of "
                         f"each token fed), got {value!r}")
    return a, b


@dataclass(frozen=True)
class DeviceRates:
    """Sustained rates of a device class: rough constants (about 80% of peak memory bandwidth and
    65% of dense peak FLOP/s), never measured at run time; the host overheads below were measured
    once on an H100 host (their comments say where)."""
    bandwidth: float  # bytes/s: streaming the weights
    flops_16: float  # FLOP/s: fp16/bf16 matmuls
    flops_32: float  # FLOP/s: fp32 matmuls (no TF32)
    overhead: float  # seconds a step costs besides its forward (host work, launches)
    # A graph step with drafts from a host proposer (ngram, suffix) on the host's paths (verify
    # ahead, the launch from committed tokens): the host work between its predecessor's tokens and
    # its launch that nothing hides, draft_overhead + overhead_per_row x rows. On the H100 with
    # SmolLM2, such a step cost its replay plus ~0.25 / 0.4 / 0.4 / 0.2-0.4 / 0.3-1.1 ms at
    # 1 / 4 / 8 / 16 / 64 rows (step_kinds: graph_drafts against graph, less the replays'
    # difference; results/spec_device_verify_b1_h100.json, _b4_b8_, _b16_, _b16_repeats_, _b64_).
    draft_overhead: float = 0.0
    overhead_per_row: float = 0.0
    # ... one built on the device from its predecessor's argmax (engine/device_verify.py): 0-0.05 ms
    # more than a decode step at 1-16 rows (graph_drafts_device, same files) ...
    built_overhead: float = 0.0
    # ... and one drafted by a drafting layer (EAGLE-3, MTP, a draft model), whose catch-up and chain
    # run after the predecessor's tokens: its forwards are priced apart (HeadGraphs), the host work
    # around them here. Not re-measured since the launch paths above; these are the figures the
    # policy used before them (0.64 / 1.16 / 1.8 ms at 1 / 16 / 64 rows, spec_suffix_k16_h100.json),
    # below what EAGLE-3's drafting steps cost over their replay and head forwards (~1.1 ms at batch 1).
    drafter_overhead: float = 0.0
    drafter_overhead_per_row: float = 0.0
    # ... and a drafting layer's step built on the device (spec_decode/layer_device_drafts.py): its
    # launch (the catch-up, first draft and chain queued, next_verify_step's halves) is host work
    # the GPU waits for at batch 1, forwards included. H100, SmolLM2 and the shipped head, k = 4
    # every step: 1.67 ms against a decode step's 1.14 (~1.05 for the q = 5 replay), 1.64 against
    # 1.31 at 16 rows (results/spec_eagle3_device_loop_b1_h100.json, _b16_; the host's speed moves
    # it: 1.71-2.1 ms in two other calls before draft 1 moved into the chain's graph).
    built_drafter_overhead: float = 0.0


# CUDA devices by name (first match, case-insensitive, in torch.cuda.get_device_name), others the
# default: rates below an H100's balance, so that verify tokens look dearer there, not cheaper.
# The overheads are the host's (the same for every device of these hosts).
_HOST = dict(draft_overhead=3e-4, overhead_per_row=6e-6, built_overhead=5e-5, drafter_overhead=6e-4,
             drafter_overhead_per_row=1.9e-5, built_drafter_overhead=6e-4)
CUDA_DEVICES: tuple[tuple[str, DeviceRates], ...] = (
    ("H200", DeviceRates(3.9e12, 6.4e14, 4.4e13, 6e-4, **_HOST)),  # GH200 too
    ("H100 PCIe", DeviceRates(1.6e12, 4.9e14, 3.3e13, 6e-4, **_HOST)),
    ("H100 NVL", DeviceRates(3.1e12, 5.4e14, 3.9e13, 6e-4, **_HOST)),
    ("H100", DeviceRates(2.7e12, 6.4e14, 4.4e13, 6e-4, **_HOST)),  # SXM
)
CUDA_DEFAULT = DeviceRates(1.0e12, 1.0e14, 1.5e13, 6e-4, **_HOST)
# CPUs: per core (torch's thread count), by torch's SIMD capability; bandwidth saturates at a socket's.
CPU_BANDWIDTH_PER_CORE, CPU_BANDWIDTH_MAX = 8e9, 1.2e11
CPU_FLOPS_PER_CORE = {"AVX512": 9.6e10, "AVX2": 4.8e10}  # fp32 FMA units; bf16 is counted as fp32
CPU_FLOPS_PER_CORE_DEFAULT = 1.6e10
CPU_OVERHEAD = 1e-3


def device_rates(device: torch.device | str, device_name: str | None = None, cpu_cores: int | None = None,
                 cpu_capability: str | None = None) -> DeviceRates:
    """The rates of a device: CUDA by name (None: torch.cuda.get_device_name), CPU by cores (None:
    torch.get_num_threads()) and SIMD capability (None: torch.backends.cpu.get_cpu_capability())."""
    device = torch.device(device)
    if device.type == "cuda":
        name = (device_name if device_name is not None else torch.cuda.get_device_name(device)).lower()
        return next((rates for key, rates in CUDA_DEVICES if key.lower() in name), CUDA_DEFAULT)
    if device.type != "cpu":
        return CUDA_DEFAULT
    cores = max(1, cpu_cores if cpu_cores is not None else torch.get_num_threads())
    capability = cpu_capability if cpu_capability is not None else torch.backends.cpu.get_cpu_capability()
    per_core = next((f for key, f in CPU_FLOPS_PER_CORE.items() if capability.upper().startswith(key)),
                    CPU_FLOPS_PER_CORE_DEFAULT)
    return DeviceRates(min(cores * CPU_BANDWIDTH_PER_CORE, CPU_BANDWIDTH_MAX), cores * per_core, cores * per_core,
                       CPU_OVERHEAD, draft_overhead=CPU_OVERHEAD, built_overhead=CPU_OVERHEAD,
                       drafter_overhead=CPU_OVERHEAD, built_drafter_overhead=CPU_OVERHEAD)


def modelled_step_cost(num_params: int, weight_bytes: int, device: torch.device | str, dtype: torch.dtype,
                       **device_kw: Any) -> StepCost:
    """(a, b) of a decode step on this device (device_kw: device_rates' overrides):
        a = weight_bytes / bandwidth + overhead   streaming the weights once, and the host's work
        b = 2 num_params / FLOP/s                 the matmuls of one more token fed
    A sum, not the roofline's max: a token is charged its FLOPs even where they would hide under the
    weight stream, which errs towards fewer drafts. Attention is left out (its KV reads and FLOPs grow
    with the context, not with the weights)."""
    rates = device_rates(device, **device_kw)
    flops = rates.flops_32 if dtype == torch.float32 else rates.flops_16
    return weight_bytes / rates.bandwidth + rates.overhead, 2.0 * num_params / flops


VOCAB_TABLES = ("embed_tokens", "lm_head", "packed_lm_head")  # pyengine's models' names for them


def weight_footprint(model: torch.nn.Module) -> tuple[int, int]:
    """(matmul parameters, bytes) of the weights a step streams: each weight of two or more dims
    that the model's modules hold, once (Parameters and plain attributes: dense or oneDNN-prepacked
    tensors, pyengine's PackedLinear at its packed size); of the vocabulary tables (VOCAB_TABLES)
    only the smallest, the lm_head the logits read (the input embedding is only gathered from)."""
    seen: set[int] = set()
    weights: list[tuple[int, int]] = []
    vocab: list[tuple[int, int]] = []
    for module in model.modules():
        for name, value in [*module._parameters.items(), *vars(module).items()]:
            if value is None or id(value) in seen:
                continue
            seen.add(id(value))
            if isinstance(value, torch.Tensor):
                if value.dim() < 2 or value.numel() == 0:
                    continue
                numel, size = value.numel(), value.numel() * value.element_size()
            elif all(hasattr(value, a) for a in ("packed_bytes", "in_features", "out_features")):
                numel, size = int(value.in_features) * int(value.out_features), int(value.packed_bytes)  # PackedLinear
            else:
                continue
            (vocab if name in VOCAB_TABLES else weights).append((numel, size))
    if vocab:
        weights.append(min(vocab, key=lambda w: w[1]))
    return sum(n for n, _ in weights), sum(size for _, size in weights)


def runner_step_cost(runner: Any) -> StepCost:
    """The modelled (a, b) of a ModelRunner's decode steps: its model's weights on its device."""
    num_params, weight_bytes = weight_footprint(runner.model)
    return modelled_step_cost(num_params, weight_bytes, runner.device, runner.dtype)


GraphCosts = Callable[[int], "np.ndarray | None"]  # rows -> seconds of a step by its most drafts d = 0..k


def runner_graph_costs(runner: Any, k: int, drafter_graphs: Any = None,
                       built_rows: Callable[[], int] | None = None, drafting_layer: bool = False) -> GraphCosts | None:
    """rows -> cost[d], d = 0..k, of a ModelRunner's graph-replayed steps: the measured replay of the
    rows' bucket graph of query length d + 1 (CudaGraphRunner.measure_step_costs, run here once),
    plus for d > 0 the host work such a step does not hide (DeviceRates): built_overhead for steps
    of at most built_rows() rows, which the device loop builds from their predecessor's argmax
    (its DeviceVerifyLoop.max_rows as it stands; None: no loop), else draft_overhead and
    overhead_per_row per row (drafting_layer: EAGLE-3, MTP or a draft model drafts; then
    drafter_overhead and drafter_overhead_per_row); and,
    with a drafting layer on graphs (drafter_graphs: its HeadGraphs), d of its forwards
    (HeadGraphs.measure_forward_seconds, run here once: a catch-up and d - 1 chained drafts, each
    waited for; a drafting layer's built steps pay built_drafter_overhead instead, forwards
    included). None when the runner replays no graphs."""
    graphs = getattr(runner, "graph_runner", None)
    if graphs is None or not graphs.use_graphs:
        return None
    graphs.measure_step_costs()
    if drafter_graphs is not None:
        drafter_graphs.measure_forward_seconds()
    rates = device_rates(runner.device)

    def costs(rows: int) -> np.ndarray | None:
        replay = graphs.step_costs(rows)
        if replay is None or len(replay) < k + 1:
            return None
        out = np.array(replay[:k + 1], dtype=np.float64)
        built = built_rows is not None and rows <= built_rows()
        if built and drafting_layer:
            out[1:] += rates.built_drafter_overhead  # the layer's forwards included
            return out
        if built:
            out[1:] += rates.built_overhead
        elif drafting_layer:
            out[1:] += rates.drafter_overhead + rates.drafter_overhead_per_row * rows
        else:
            out[1:] += rates.draft_overhead + rates.overhead_per_row * rows
        if drafter_graphs is not None:
            forward = drafter_graphs.forward_cost(rows)
            if forward is None:
                return None
            out += forward * np.arange(k + 1)
        return out

    return costs


def drafter_cost_share(drafter: Any, runner: Any, a_target: float) -> float:
    """A forward of the drafting module (an MTP layer, an EAGLE-3 head, a draft model; None: no
    forward, 0) as a share of the target's decode step: the ratio of their modelled fixed costs a
    (weights streamed plus the host's work) on the runner's device; a_target: the target's
    (runner_step_cost(runner)[0])."""
    if drafter is None:
        return 0.0
    params, size = weight_footprint(drafter)
    return modelled_step_cost(params, size, runner.device, runner.dtype)[0] / a_target
