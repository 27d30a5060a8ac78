"""The trunk the Mamba2-based models share (Mamba2, Bamba, NemotronH): token embedding, a stack of
layers over one flat token batch, final RMSNorm and a (possibly tied) lm_head.

Recurrent state lives in the runner's StateCache; a standalone forward (state None) runs every row
as a prefill from zero state. The runner allocates one (K, V) pair per layer and only attention
layers use theirs (the other layers' pairs are waste of the KV budget). On the CPU prepack_for_cpu
puts every projection on the packed GEMM (each layer's pack): with the recurrent-state ops of
pyengine/ops/cpu/ssm.py a token's logits are then the same bits in any step. On CUDA, under
KernelConfig.batch_invariant, prepack_for_cuda puts the projections kept in HF's [out, in]
orientation (the mixers' in_proj / out_proj, the lm_head) on pyengine's invariant GEMM as [in, out]
copies; the norms run pyengine's row kernel (layers.rms_norm_rows) and the state ops are per-row
kernels (pyengine/ops/cuda/ssm.py), so the same holds there.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from pyengine.config import Mamba2ModelConfig
from pyengine.engine.attention_metadata import AttentionMetadata
from pyengine.engine.state_cache import StateCache, StateMetadata
from pyengine.models.layers import (Mamba2Mixer, WeightTargets, cpu_linear_packer, hf_linear, linear, onednn_prepack,
                                    pack_weights, param, rms_norm_rows)
from pyengine.models.weight_utils import load_named_weights


class InOutLinear:
    """A dense [in, out] weight as the callable that hf_linear takes for a packed one:
    (x, bias) -> layers.linear(x, weight, bias), i.e. pyengine's CUDA GEMMs (prepack_for_cuda)."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return linear(x, self.weight, bias)


class HybridForCausalLM(nn.Module):
    # HF names of the trunk's embedding and final norm
    hf_embed_name: ClassVar[str]
    hf_norm_name: ClassVar[str]
    def __init__(self, config: Mamba2ModelConfig, dtype: torch.dtype, layers: Iterable[nn.Module]) -> None:
        super().__init__()
        self.config, self.dtype = config, dtype
        vocab, hidden = config.vocab_size, config.hidden_size
        self.layers = nn.ModuleList(layers)
        self.embed_tokens = param(vocab, hidden, dtype=dtype)
        self.norm = param(hidden, dtype=dtype)
        self.lm_head: Any = None if config.tie_word_embeddings else param(vocab, hidden, dtype=dtype)  # HF [out, in]
        self.packed_lm_head: Any = None  # set by prepack_for_cpu
        self.owns_cpu_threads = False

    def prepack_for_cpu(self) -> bool:
        """Every linear on the CPU's packed GEMM (PackedLinear where this CPU runs it: batch-invariant,
        else oneDNN), lm_head included (the embedding table's transpose when tied: the table stays
        dense for the lookup). Returns False (model unchanged) where neither is available; the dense
        projections are dropped, so load_weights cannot run again."""
        if self.embed_tokens.device.type != "cpu":
            return False
        pack = cpu_linear_packer(self.embed_tokens)
        if pack is None:
            return False
        for layer in self.layers:
            layer.pack(pack)  # type: ignore[operator]
        if self.lm_head is None:
            self.packed_lm_head = pack(self.embed_tokens.detach().t())
        else:
            pack_weights(self, ("lm_head",), lambda w: pack(w.t()))
            self.packed_lm_head = self.lm_head
        self.owns_cpu_threads = pack is not onednn_prepack  # see ModelRunner.step_threads
        return True

    def prepack_for_cuda(self) -> bool:
        """Under KernelConfig.batch_invariant on CUDA (LLM calls it): the projections kept in HF's
        [out, in] orientation - each Mamba2 mixer's in_proj and out_proj, the lm_head - become
        contiguous [in, out] copies run by layers.linear (pyengine's invariant GEMM), where F.linear
        would run cuBLAS, whose kernel changes with the number of rows. The [out, in] originals go
        (load_weights cannot run again); tied embeddings keep the table for the lookup beside its
        transpose. Returns False (model unchanged) off CUDA or when done already."""
        if self.embed_tokens.device.type != "cuda" or self.packed_lm_head is not None:
            return False
        for layer in self.layers:
            mixer = getattr(layer, "mixer", None)
            if isinstance(mixer, Mamba2Mixer):
                mixer.pack(lambda w: InOutLinear(w.contiguous()))  # mixer.pack hands over the [in, out] view
        if self.lm_head is None:
            self.packed_lm_head = self.embed_tokens.detach().t().contiguous()
        else:
            pack_weights(self, ("lm_head",), lambda w: w.t().contiguous())
            self.packed_lm_head = self.lm_head
        return True

    def state_shapes(self, num_spec_tokens: int) -> list[tuple[tuple[int, ...], tuple[int, ...]] | None]:
        """Per layer (conv row shape, ssm shape), None for layers without a Mamba2 mixer: the runner
        builds its StateCache from this."""
        return [layer.mixer.state_shape(num_spec_tokens) if isinstance(getattr(layer, "mixer", None), Mamba2Mixer)
                else None for layer in self.layers]

    def run_layers(self, h: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, kv_caches: list,
                   state: StateMetadata) -> torch.Tensor:
        """Embeddings [T, hidden] -> the last layer's output (before the final norm)."""
        raise NotImplementedError

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list, state: StateMetadata | None = None) -> torch.Tensor:
        """input_ids/positions [T] -> final-norm hidden [T, hidden]; kv_caches[i] for attention layer i."""
        if state is None:
            state = StateCache.scratch(self, meta.query_start_loc, self.dtype, input_ids.device)
        h = self.run_layers(F.embedding(input_ids, self.embed_tokens), positions, meta, kv_caches, state)
        return rms_norm_rows(h, self.norm, self.config.rms_norm_eps)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.packed_lm_head is not None:
            return linear(hidden, self.packed_lm_head).float()
        return hf_linear(hidden, self.embed_tokens if self.lm_head is None else self.lm_head).float()

    def weight_targets(self) -> WeightTargets:
        """HF name -> (parameter, destination view [out, in]) for the trunk; models add their layers'."""
        t: WeightTargets = {self.hf_embed_name: (self.embed_tokens, self.embed_tokens),
                            self.hf_norm_name: (self.norm, self.norm)}
        if self.lm_head is not None:
            t["lm_head.weight"] = (self.lm_head, self.lm_head)
        return t

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """HF names; every parameter must be covered exactly, else ValueError."""
        load_named_weights(self, self.weight_targets(), weights, self.lm_head is None)
