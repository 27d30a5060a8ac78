"""Mixture of experts: DeepSeek-V3's (a sigmoid router with a score-correction bias and
group-limited top-k, routed SwiGLU experts, shared experts) and Qwen3-Next's (a softmax router, one
shared expert scaled by a sigmoid gate).

Batch invariance (docs/architecture.md): a token's output must not depend on which other tokens
chose its experts. On the CPU each expert runs its tokens through linear(), whose packed GEMM
computes a row the same way for every M; the top-k outputs of a token are then summed in its own
slot order (0..k-1), never in an order the batch decides. On CUDA the routed experts run as two
grouped GEMMs (one group per expert, no host synchronisation, so steps can be CUDA graphs): under
KernelConfig.batch_invariant pyengine's grouped invariant GEMM (ops.grouped_linear: a row's bits
are those of the row alone with its expert's weight), else torch._grouped_mm (bf16), whose row
invariance is not established. Top-k ties go to the lower expert index (a stable sort), a rule of
the row alone; torch.topk's tie order follows its kernel choice, which follows the tensor's shape.
"""
from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Iterable
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from pyengine import ops
from pyengine.models.layers import WeightTargets, linear, pack_weights, param, rowwise
from pyengine.ops.kernel_config import get_kernel_config


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


def top_indices(values: torch.Tensor, k: int) -> torch.Tensor:
    """The indices of each row's k largest values [T, k], largest first, ties to the lower index."""
    return torch.sort(values, dim=-1, descending=True, stable=True)[1][:, :k].contiguous()


def route(logits: torch.Tensor, bias: torch.Tensor | None, cfg: MoEConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] fp32 -> (expert ids [T, k] int64, combine weights [T, k] fp32), per row.
    Selection ranks the scores (sigmoid or softmax) + bias inside the topk_group groups whose top-2
    biased scores sum highest (ties to the lower index: top_indices); the weights are the unbiased
    scores of the chosen experts (normalised if norm_topk_prob), times routed_scaling_factor."""
    scores = rowwise(torch.sigmoid, logits) if cfg.scoring_func == "sigmoid" else torch.softmax(logits, dim=-1)
    choice = scores if bias is None else scores + bias
    if cfg.n_group > 1:
        t = choice.shape[0]
        grouped = choice.view(t, cfg.n_group, -1)
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)  # [T, n_group]
        keep = top_indices(group_scores, cfg.topk_group)
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
        choice = grouped.masked_fill(~group_mask[:, :, None], float("-inf")).view(t, -1)
    ids = top_indices(choice, cfg.top_k)
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
        self._padded_gate: tuple[tuple[int, int], torch.Tensor] | None = None  # (weight's ptr, version), padded

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
                shared = shared * rowwise(torch.sigmoid, self._shared_gate_logit(x).float())
            out = out + shared
        return out.to(x.dtype)

    def runs_grouped_on_cuda(self, dtype: torch.dtype) -> bool:
        """Whether CUDA runs the stacked experts as grouped GEMMs: under KernelConfig.batch_invariant
        pyengine's (fp16/bf16 on NVIDIA, widths multiples of 64; elsewhere the experts run one at a
        time through linear(), invariant too), else torch's (bf16, sm_90, 16-aligned widths)."""
        if not isinstance(self.w_gate_up, torch.Tensor):
            return False
        hidden, inter = self.w_gate_up.shape[1], self.w_down.shape[1]
        if get_kernel_config().batch_invariant:
            return (torch.version.hip is None and dtype in (torch.float16, torch.bfloat16)
                    and hidden % 64 == 0 and inter % 64 == 0)
        return dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm") and hidden % 16 == 0 and inter % 16 == 0

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
        rows = x.index_select(0, order // k)
        if get_kernel_config().batch_invariant:  # each row as if alone with its expert's weight
            y = ops.grouped_linear(ops.silu_and_mul(ops.grouped_linear(rows, self.w_gate_up, offs)), self.w_down, offs)
        else:
            y = torch._grouped_mm(ops.silu_and_mul(torch._grouped_mm(rows, self.w_gate_up, offs=offs)), self.w_down,
                                  offs=offs)
        return torch.empty_like(y).index_copy_(0, order, y)

    def _shared_gate_logit(self, x: torch.Tensor) -> torch.Tensor:
        """x . shared_expert_gate [T, 1]. Under batch_invariant on CUDA the weight's one column is
        padded to 8 (the invariant GEMM's N granularity) and the first column kept."""
        w = self.shared_expert_gate
        if x.is_cuda and isinstance(w, torch.Tensor) and get_kernel_config().batch_invariant and w.shape[1] % 8:
            key = (w.data_ptr(), w._version)  # padded once, again only if the weight changed
            if self._padded_gate is None or self._padded_gate[0] != key:
                self._padded_gate = (key, F.pad(w, (0, -w.shape[1] % 8)))
            return linear(x, self._padded_gate[1])[:, :w.shape[1]]
        return linear(x, w)

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
