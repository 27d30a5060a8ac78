"""Copying HF-named checkpoint tensors into a model's parameters, with full-coverage checks."""
from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from pyengine.models.layers import WeightTargets


def load_named_weights(model: nn.Module, targets: WeightTargets, weights: Iterable[tuple[str, torch.Tensor]],
                       tied: bool, transform: Callable[[str, torch.Tensor], torch.Tensor] | None = None) -> None:
    """Copy each (HF name, tensor) into targets[name]'s view. lm_head.weight is skipped when tied and
    rotary inv_freq always (derived from the config); Mamba2 conv1d weights [dim, 1, W] become
    [dim, W]; transform(name, tensor) then applies a model's own layout. Every target and every
    non-empty parameter of model must be covered, else ValueError."""
    seen: set[str] = set()
    for name, tensor in weights:
        if (name == "lm_head.weight" and tied) or name.endswith("rotary_emb.inv_freq"):
            continue
        if name not in targets:
            raise ValueError(f"unexpected checkpoint tensor {name}")
        _, dst = targets[name]
        src = tensor.flatten(1) if name.endswith("conv1d.weight") else tensor
        if transform is not None:
            src = transform(name, src)
        if tuple(src.shape) != tuple(dst.shape):
            raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != expected {tuple(dst.shape)}")
        with torch.no_grad():
            dst.copy_(src)
        seen.add(name)
    missing = sorted(set(targets) - seen)
    if missing:
        raise ValueError(f"checkpoint does not cover {missing[:4]}{' ...' if len(missing) > 4 else ''}")
    covered = {id(p) for p, _ in targets.values()}
    for pname, p in model.named_parameters():
        if id(p) not in covered and p.numel():
            raise ValueError(f"checkpoint does not cover parameter {pname}")


def decoder_weight_targets(model: nn.Module) -> WeightTargets:
    """The HF targets of a decoder whose layers name their own tensors (layer.weight_targets(prefix)):
    model.embed_tokens, model.norm, lm_head.weight ([out, in]; absent when model.lm_head is None:
    tied), model.layers.{i}.*, and the MTP layer's (model.mtp, when loaded)."""
    targets: WeightTargets = {"model.embed_tokens.weight": (model.embed_tokens, model.embed_tokens),
                              "model.norm.weight": (model.norm, model.norm)}
    if model.lm_head is not None:
        targets["lm_head.weight"] = (model.lm_head, model.lm_head.t())
    for i, layer in enumerate(model.layers):
        targets.update(layer.weight_targets(f"model.layers.{i}."))
    if model.mtp is not None:
        targets.update(model.mtp.weight_targets())
    return targets
