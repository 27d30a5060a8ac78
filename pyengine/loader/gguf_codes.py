"""A GGUF Llama's Q4_0 / Q4_1 / Q8_0 linears packed for the CPU GEMM straight from the file's blocks.

The general path (gguf_file.iter_gguf_weights -> LlamaForCausalLM.load_weights -> PackedLinear)
dequantises every weight to float32 and lets the C++ packer search each 32-input run for the scale,
offset and codes that rebuild it: ~1.5 s of a ~3 s load on a 2-core EPYC. The file holds exactly
those codes and scales already, so here a linear goes from the addresses of its rows in the map
(q/k rows reordered and fused projections concatenated as addresses, nothing copied) to
PackedLinear.from_gguf, and a tied Q8_0 embedding is read back from the packed lm_head's codes
(PackedColumns): the same weights bit for bit (csrc/cpu/cpu_gguf_pack.h says why), with no
float32 copy made and no second copy of the codes. Where each tensor goes is the
model's own mapping (its _place, run with a put that collects rows instead of copying them);
whatever cannot go this way (another type, a fused linear of mixed types, a non-finite scale, a
misshapen tensor) is left to load_weights, which packs or reports it as before.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from pyengine.config import ModelConfig
from pyengine.loader.gguf_dequant import Q4_0, Q4_1, Q8_0
from pyengine.loader.gguf_reader import GGML_BLOCKS, GGUFFile, GGUFTensor

CODE_TYPES = (Q4_0, Q4_1, Q8_0)


@dataclass
class Rows:
    """A GGUF matrix's rows in the model's order: the address of each one's first block."""

    tensor: GGUFTensor
    addresses: np.ndarray  # uint64 [rows]
    cols: int


def rows_of(reader: GGUFFile, tensor: GGUFTensor, order: Callable[[np.ndarray], np.ndarray]) -> Rows:
    """tensor's rows (the map stays open while they are used); order: a reordering along axis 0
    (the one applied to the weights, here applied to row numbers)."""
    rows, cols = tensor.shape
    row_bytes = cols // GGML_BLOCKS[tensor.ggml_type][0] * GGML_BLOCKS[tensor.ggml_type][1]
    base = reader.data(tensor).ctypes.data  # a checked view: the tensor lies inside the file
    return Rows(tensor, np.uint64(base) + order(np.arange(rows, dtype=np.uint64)) * np.uint64(row_bytes), cols)


@dataclass
class _Target:
    """The rows of one model parameter collected so far: (first row, Rows) each."""

    rows: int  # HF rows ([out, in] orientation) the parameter needs
    cols: int
    pieces: list[tuple[int, Rows]] = field(default_factory=list)

    def complete(self) -> bool:
        return sum(len(r.addresses) for _, r in self.pieces) == self.rows


def pack_from_codes(model: Any, reader: GGUFFile, config: ModelConfig, rows: Callable[[GGUFTensor], Rows]) -> set[str]:
    """Pack model's decoder linears and lm_head (tied: also the embedding table) from the blocks of
    `reader`'s tensors; returns the names of the GGUF tensors used up, for load_weights to skip.
    rows(tensor): its rows in the model's order. Packs nothing unless the model is a Llama-family
    one that packs fp32 weights with PackedLinear here."""
    from pyengine.loader.gguf_file import hf_name_of  # gguf_file imports this module
    from pyengine.models.layers import LlamaDecoderLayer, cpu_linear_packer
    from pyengine.models.llama import LlamaForCausalLM

    if not isinstance(model, LlamaForCausalLM) or model.lm_head.dtype != torch.float32:
        return set()
    try:
        from pyengine.ops.cpu import PackedLinear
    except ImportError:
        return set()
    if cpu_linear_packer(model.lm_head) is not PackedLinear:
        return set()
    owners: dict[int, tuple[Any, str]] = {id(model.lm_head): (model, "lm_head")}
    for layer in model.layers:
        for name in LlamaDecoderLayer.LINEAR_NAMES:
            owners[id(getattr(layer, name))] = (layer, name)
    targets: dict[int, _Target] = {}
    used: set[str] = set()

    def collect(target: Any, name: str, src: Rows, start: int = 0, count: int | None = None) -> None:
        if not isinstance(target, torch.nn.Parameter) or id(target) not in owners:
            return  # load_weights places (or refuses) it
        hf_rows, cols = target.shape[1], target.shape[0]  # [in, out] parameters
        if len(src.addresses) != (hf_rows if count is None else count) or src.cols != cols:
            return  # misshapen: load_weights says how
        entry = targets.setdefault(id(target), _Target(hf_rows, cols))
        entry.pieces.append((start, src))
        if entry.complete():
            del targets[id(target)]
            owner, attr = owners[id(target)]
            if _pack(model, owner, attr, entry, PackedLinear):
                for _, r in entry.pieces:
                    used.add(r.tensor.name)
                    reader.release(r.tensor.offset, r.tensor.offset + r.tensor.nbytes)

    for tensor in reader.tensors:
        if tensor.ggml_type in CODE_TYPES and len(tensor.shape) == 2:
            hf_name = hf_name_of(tensor.name, config)
            if hf_name is not None:
                model._place(hf_name, rows(tensor), collect)
    if used:
        model._cpu_pack = PackedLinear  # what prepack_for_cpu packs the rest with
    return used


def _pack(model: Any, owner: Any, attr: str, target: _Target, packed_linear: Any) -> bool:
    """Pack one complete parameter from its pieces and put it in place; False (nothing changed)
    where its pieces cannot be one packed weight."""
    pieces = [r for _, r in sorted(target.pieces, key=lambda p: p[0])]
    types = {r.tensor.ggml_type for r in pieces}
    is_lm_head = owner is model and attr == "lm_head"
    tied = is_lm_head and model.embed_tokens is None
    if len(types) != 1 or (tied and types != {Q8_0}):
        return False  # mixed types; a tied table of 4-bit values (load_weights keeps it dense to embed)
    addresses = pieces[0].addresses if len(pieces) == 1 else np.concatenate([r.addresses for r in pieces])
    packed = packed_linear.from_gguf(types.pop(), addresses, target.cols)
    if packed is None:
        return False
    if is_lm_head:
        model.packed_lm_head = packed
        if tied:  # embeddings read from the packed codes: d * q, no second copy of them
            from pyengine.models.llama import PackedColumns
            model.embedding_columns = PackedColumns(packed)
        model.lm_head.data = torch.empty(0, dtype=model.lm_head.dtype)  # as _pack_lm_head leaves it
    else:
        delattr(owner, attr)  # as pack_weights replaces a parameter
        setattr(owner, attr, packed)
    return True
