"""Mixture of experts: DeepSeek-V3's (a sigmoid router with a score-correction bias and
group-limited top-k, routed SwiGLU experts, shared experts) and Qwen3-Next's (a softmax router, one
shared expert scaled by a sigmoid gate).

Batch invariance (docs/architecture.md): a token's output must not depend on which other tokens
chose its experts. On the CPU each expert runs its tokens through linear(), whose packed GEMM
computes a row the same way for every M; the top-k outputs of a token are then summed in its own
slot order (0..k-1), never in an order the batch decides. On CUDA (bf16) the routed experts run as
two grouped GEMMs (torch._grouped_mm, one group per expert, no host synchronisation); that
kernel's row invariance is not established, and LLM(batch_invariant=True) refuses these models on
CUDA.
"""
from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Iterable
from typing import Any, Callable

import torch
from torch import nn

from pyengine import ops
from pyengine.models.layers import WeightTargets, linear, pack_weights, param, rowwise


@dataclass
class MoEConfig:
    num_experts: int
    top_k: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    n_shared_experts: int
    moe_intermediate_size: int
    scoring_func: str = "sigmoid"  # or "softmax"
    correction_bias: bool = True  # e_score_correction_bias (DeepSeek-V3)
    shared_intermediate_size: int | None = None  # None: moe_intermediate_size * n_shared_experts
    shared_expert_gate: bool = False  # Qwen3-Next: the shared expert's output times sigmoid(x . w)
    hf_shared_name: str = "shared_experts"  # Qwen3-Next: "shared_expert"

    def validate(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok ({self.top_k}) must be in 1..n_routed_experts ({self.num_experts})")
        if self.n_group < 1 or self.num_experts % self.n_group:
            raise ValueError(f"n_routed_experts ({self.num_experts}) must be a multiple of n_group ({self.n_group})")
        per_group = self.num_experts // self.n_group
        if not 1 <= self.topk_group <= self.n_group or self.topk_group * per_group < self.top_k:
            raise ValueError(f"topk_group ({self.topk_group}) of n_group ({self.n_group}) groups holds fewer than "
                             f"num_experts_per_tok ({self.top_k}) experts")
        if self.n_group > 1 and per_group < 2:
            raise ValueError("group-limited routing scores a group by its top-2 experts: need >= 2 experts per group")
        if self.scoring_func not in ("sigmoid", "softmax"):
            raise ValueError(f"unsupported MoE scoring_func {self.scoring_func!r} (supported: sigmoid, softmax)")


def route(logits: torch.Tensor, bias: torch.Tensor | None, cfg: MoEConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] fp32 -> (expert ids [T, k] int64, combine weights [T, k] fp32), per row.
    Selection ranks the scores (sigmoid or softmax) + bias inside the topk_group groups whose top-2
    biased scores sum highest; the weights are the unbiased scores of the chosen experts (normalised
    if norm_topk_prob), times routed_scaling_factor."""
    scores = rowwise(torch.sigmoid, logits) if cfg.scoring_func == "sigmoid" else torch.softmax(logits, dim=-1)
    choice = scores if bias is None else scores + bias
    if cfg.n_group > 1:
        t = choice.shape[0]
        grouped = choice.view(t, cfg.n_group, -1)
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)  # [T, n_group]
        keep = group_scores.topk(cfg.topk_group, dim=-1)[1]
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
        choice = grouped.masked_fill(~group_mask[:, :, None], float("-inf")).view(t, -1)
    ids = choice.topk(cfg.top_k, dim=-1, sorted=True)[1]
    weights = scores.gather(1, ids)
    if cfg.norm_topk_prob:
        total = weights[:, 0:1]
        for j in range(1, cfg.top_k):  # in slot order: a reduction kernel may order the adds by the batch
            total = total + weights[:, j:j + 1]
        weights = weights / (total + 1e-20)
    return ids, weights * cfg.routed_scaling_factor


def moe_graphable(layers: Iterable[nn.Module], dtype: torch.dtype) -> bool:
    """Whether a model's decode/verify steps can replay CUDA graphs: every MoE layer (layer.mlp)
    runs the grouped path, which reads no expert count on the host."""
    return all(layer.mlp.runs_grouped_on_cuda(dtype) for layer in layers if isinstance(layer.mlp, MoE))


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)); gate|up fused, weights [in, out]."""

    def __init__(self, hidden: int, inter: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.inter = inter
        self.gate_up_proj: Any = param(hidden, 2 * inter, dtype=dtype)
        self.down_proj: Any = param(inter, hidden, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(ops.silu_and_mul(linear(x, self.gate_up_proj)), self.down_proj)

    def weight_targets(self, prefix: str) -> WeightTargets:
        gu = self.gate_up_proj.t()
        return {prefix + "gate_proj.weight": (self.gate_up_proj, gu.narrow(0, 0, self.inter)),
                prefix + "up_proj.weight": (self.gate_up_proj, gu.narrow(0, self.inter, self.inter)),
                prefix + "down_proj.weight": (self.down_proj, self.down_proj.t())}

    def pack(self, pack: Callable[[torch.Tensor], Any]) -> None:
        pack_weights(self, ("gate_up_proj", "down_proj"), pack)


class MoE(nn.Module):
    """Routed experts + shared experts over normed hidden states [T, hidden] (HF names under
    `prefix`: gate.weight, gate.e_score_correction_bias, experts.{e}.{gate,up,down}_proj.weight,
    shared_experts.{gate,up,down}_proj.weight). Routed experts run as two grouped GEMMs on CUDA
    (bf16), else one expert at a time through linear()."""

    def __init__(self, hidden: int, cfg: MoEConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.cfg = cfg
        # The router runs in fp32, as trained: a bf16 logit flips near-equal experts.
        self.gate: Any = param(hidden, cfg.num_experts, dtype=torch.float32)
        self.e_score_correction_bias = param(cfg.num_experts, dtype=torch.float32) if cfg.correction_bias else None
        # Routed experts stacked, [in, out] per expert: the GPU runs them as one grouped GEMM each.
        e, i = cfg.num_experts, cfg.moe_intermediate_size
        self.w_gate_up: Any = param(e, hidden, 2 * i, dtype=dtype)
        self.w_down: Any = param(e, i, hidden, dtype=dtype)
        self.packed_experts: list[tuple[Any, Any]] | None = None  # CPU: (gate_up, down) packed per expert
        inter = cfg.shared_intermediate_size or cfg.moe_intermediate_size * cfg.n_shared_experts
        self.shared_experts = SwiGLU(hidden, inter, dtype) if inter else None
        self.shared_expert_gate: Any = param(hidden, 1, dtype=dtype) if cfg.shared_expert_gate else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t, k = x.shape[0], self.cfg.top_k
        ids, weights = route(linear(x.float(), self.gate), self.e_score_correction_bias, self.cfg)
        routed = self._grouped(x, ids) if self._runs_grouped(x) else self._per_expert(x, ids)
        routed = routed.view(t, k, -1).float()
        out = routed[:, 0] * weights[:, 0:1]
        for j in range(1, k):  # the token's own slot order: no batch-dependent summation order
            out = out + routed[:, j] * weights[:, j:j + 1]
        if self.shared_experts is not None:
            shared = self.shared_experts(x).float()
            if self.shared_expert_gate is not None:
                shared = shared * rowwise(torch.sigmoid, linear(x, self.shared_expert_gate).float())
            out = out + shared
        return out.to(x.dtype)

    def runs_grouped_on_cuda(self, dtype: torch.dtype) -> bool:
        """bf16 with 16-aligned widths: torch's grouped GEMM (sm_90) over the stacked experts."""
        return (dtype == torch.bfloat16 and isinstance(self.w_gate_up, torch.Tensor) and hasattr(torch, "_grouped_mm")
                and self.w_gate_up.shape[1] % 16 == 0 and self.w_down.shape[1] % 16 == 0)

    def _runs_grouped(self, x: torch.Tensor) -> bool:
        return x.is_cuda and self.runs_grouped_on_cuda(x.dtype)

    def _grouped(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Every (token, choice) row sorted by expert, each expert's rows one group of two grouped
        GEMMs; no host synchronisation (counts stay on the device)."""
        k, e = self.cfg.top_k, self.cfg.num_experts
        slots = ids.view(-1)  # token i's choice j at flat index i * k + j
        order = torch.argsort(slots, stable=True)
        counts = torch.zeros(e, dtype=torch.int32, device=x.device).index_add_(
            0, slots, torch.ones_like(slots, dtype=torch.int32))
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        h = torch._grouped_mm(x.index_select(0, order // k), self.w_gate_up, offs=offs)
        y = torch._grouped_mm(ops.silu_and_mul(h), self.w_down, offs=offs)
        return torch.empty_like(y).index_copy_(0, order, y)

    def _per_expert(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Each hit expert over its tokens through linear() (the CPU's packed GEMM: a row's bits do
        not depend on how many tokens chose the expert)."""
        k = self.cfg.top_k
        slots = ids.view(-1)
        order = torch.argsort(slots, stable=True)
        counts = torch.bincount(slots, minlength=self.cfg.num_experts).tolist()
        routed = torch.empty(slots.shape[0], x.shape[1], dtype=x.dtype, device=x.device)
        start = 0
        for e, n in enumerate(counts):
            if n:
                flat = order[start:start + n]
                gate_up, down = (self.packed_experts[e] if self.packed_experts is not None
                                 else (self.w_gate_up[e], self.w_down[e]))
                routed[flat] = linear(ops.silu_and_mul(linear(x.index_select(0, flat // k), gate_up)), down)
                start += n
        return routed

    def weight_targets(self, prefix: str) -> WeightTargets:
        targets: WeightTargets = {prefix + "gate.weight": (self.gate, self.gate.t())}
        if self.e_score_correction_bias is not None:
            bias = self.e_score_correction_bias
            targets[prefix + "gate.e_score_correction_bias"] = (bias, bias)
        i = self.cfg.moe_intermediate_size
        for e in range(self.cfg.num_experts):
            gu, p = self.w_gate_up[e].t(), f"{prefix}experts.{e}."  # HF [out, in] views of expert e
            targets[p + "gate_proj.weight"] = (self.w_gate_up, gu.narrow(0, 0, i))
            targets[p + "up_proj.weight"] = (self.w_gate_up, gu.narrow(0, i, i))
            targets[p + "down_proj.weight"] = (self.w_down, self.w_down[e].t())
        if self.shared_experts is not None:
            targets.update(self.shared_experts.weight_targets(f"{prefix}{self.cfg.hf_shared_name}."))
        if self.shared_expert_gate is not None:
            targets[prefix + "shared_expert_gate.weight"] = (self.shared_expert_gate, self.shared_expert_gate.t())
        return targets

    def pack(self, pack: Callable[[torch.Tensor], Any], pack_router: Callable[[torch.Tensor], Any] | None) -> None:
        self.packed_experts = [(pack(gu), pack(d)) for gu, d in zip(self.w_gate_up.detach(), self.w_down.detach())]
        del self.w_gate_up, self.w_down  # the packed copies replace them
        self.w_gate_up = self.w_down = None
        if self.shared_experts is not None:
            self.shared_experts.pack(pack)
        pack_weights(self, ("shared_expert_gate",), pack)
        if pack_router is not None:
            pack_weights(self, ("gate",), pack_router)
