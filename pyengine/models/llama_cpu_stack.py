"""A CPU step through all of a Llama model's decoder layers in one C++ call
(csrc/cpu/cpu_llama_stack.h: the same ops as LlamaDecoderLayer.forward, in the same order, on the same
values; hidden states equal bit for bit). It saves the per-op Python crossings, checks and
allocations of the layer loop.

Taken when the model's linears are pyengine's PackedLinear, the layers have no qkv bias or q/k
norm, the KV cache has the model's dtype (so the C++ attention kernel runs, as it would op by op)
and KernelConfig.cpu_layer_stack is on. Steps of every size take it, long prefills included: the
C++ attention runs every step itself (pyengine.ops.cpu.attention), so the op-by-op path has no
other implementation to switch to, and either path gives the same bits.
"""
from __future__ import annotations

import torch
from torch import nn

from pyengine.config import ModelConfig
from pyengine.engine.attention_metadata import AttentionMetadata
from pyengine.models.layers import KVCache, LlamaDecoderLayer
from pyengine.ops.cpu import PackedLinear  # ImportError without the extension's CPU ops: no stack
from pyengine.ops.cpu.attention import runs_kernel, step_tables
from pyengine.ops.cpu.extension import DTYPE_CODE, kernels, pool_threads, raise_error
from pyengine.ops.kernel_config import get_kernel_config


class CpuLlamaStack:
    def __init__(self, layers: nn.ModuleList, config: ModelConfig, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.head_dim = config.head_dim
        weights = []  # raw pointers into weights the model (which holds this stack) owns
        for layer in layers:
            linears = [getattr(layer, name) for name in LlamaDecoderLayer.LINEAR_NAMES]
            weights.append((*(w.packed for w in linears), layer.input_layernorm.data_ptr(),
                            layer.post_attention_layernorm.data_ptr()))
        self._stack = kernels.LlamaStack(weights, config.hidden_size, config.num_attention_heads,
                                         config.num_key_value_heads, config.head_dim, config.intermediate_size,
                                         config.rms_norm_eps, layers[0].scale, DTYPE_CODE[dtype])
        self._kv_seen: tuple[list[KVCache], tuple[list[int], list[int], int, int]] | None = None

    @staticmethod
    def build(layers: nn.ModuleList, config: ModelConfig, dtype: torch.dtype) -> CpuLlamaStack | None:
        """The stack for a prepacked CPU model, or None where a layer needs the op-by-op path."""
        if dtype not in DTYPE_CODE or config.head_dim % 16:
            return None
        for layer in layers:
            if not isinstance(layer, LlamaDecoderLayer) or layer.qkv_bias is not None or layer.qk_norm is not None:
                return None
            if not all(isinstance(getattr(layer, n, None), PackedLinear) and getattr(layer, n).dtype == dtype
                       for n in LlamaDecoderLayer.LINEAR_NAMES):
                return None
        return CpuLlamaStack(layers, config, dtype)

    def applies(self, meta: AttentionMetadata, kv_caches: list[KVCache]) -> bool:
        """Whether the C++ attention takes this step (else the op-by-op path runs it)."""
        return meta.num_tokens > 0 and runs_kernel(self.dtype, kv_caches[0][0].dtype, self.head_dim)

    def _cache_pointers(self, kv_caches: list[KVCache]) -> tuple[list[int], list[int], int, int]:
        """The K and V caches' data pointers, block size and block count, checked once per set of
        cache tensors (the runner keeps the same list of (K, V) tuples step after step)."""
        seen = self._kv_seen
        if seen is not None and len(seen[0]) == len(kv_caches) and all(a is b for a, b in zip(seen[0], kv_caches)):
            return seen[1]
        if len(kv_caches) != self._stack.num_layers:
            raise ValueError(f"{len(kv_caches)} KV caches for {self._stack.num_layers} layers")
        k0 = kv_caches[0][0]
        for k, v in kv_caches:
            if k.shape != k0.shape or v.shape != k0.shape or not (k.is_contiguous() and v.is_contiguous()):
                raise ValueError(f"every layer's K/V cache must be contiguous {tuple(k0.shape)}")
        pointers = ([k.data_ptr() for k, _ in kv_caches], [v.data_ptr() for _, v in kv_caches], k0.shape[1], k0.shape[0])
        self._kv_seen = (list(kv_caches), pointers)
        return pointers

    def __call__(self, h: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None, meta: AttentionMetadata,
                 kv_caches: list[KVCache], positions: torch.Tensor | None = None,
                 final_norm: torch.Tensor | None = None, aux_layers: tuple[int, ...] = (),
                 aux: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Embeddings h [T, hidden] -> (last layer's MLP output, residual stream), as the layer loop
        of LlamaForCausalLM.forward returns them. With positions, cos and sin are the rotary
        tables [max_positions, D] and token t takes row positions[t] (RotaryEmbedding's
        index_select, in C++). With final_norm [hidden], the model's final fused add + norm runs
        here too: h comes back as norm(residual + h), the op-by-op path's bits. With aux_layers,
        the residual stream at the input of each of those layers goes to aux [T, >= n * hidden]
        (row-contiguous), layer aux_layers[j] at columns j * hidden.. (the number of layers: the
        stream before the final norm, written only with final_norm)."""
        k_ptrs, v_ptrs, block_size, num_blocks = self._cache_pointers(kv_caches)
        bt, qsl, ctx, _ = step_tables(meta)
        h = h.contiguous()
        residual = torch.empty_like(h)
        num_positions = 0
        if positions is not None:
            positions = positions if positions.dtype == torch.int64 else positions.to(torch.int64)
            positions = positions.contiguous()
            num_positions = cos.shape[0]
        if cos.dtype != self.dtype or sin.dtype != self.dtype:
            cos, sin = cos.to(self.dtype), sin.to(self.dtype)
        cos, sin = cos.contiguous(), sin.contiguous()
        slots = meta.slot_mapping.contiguous()
        raise_error(self._stack.forward(
            h.data_ptr(), residual.data_ptr(), h.shape[0], cos.data_ptr(), sin.data_ptr(), slots.data_ptr(),
            bt.data_ptr(), bt.shape[1], qsl.data_ptr(), ctx.data_ptr(), ctx.shape[0], k_ptrs, v_ptrs, block_size,
            num_blocks, pool_threads(), 0 if positions is None else positions.data_ptr(), num_positions,
            0 if final_norm is None else final_norm.contiguous().data_ptr(), list(aux_layers),
            0 if aux is None else aux.data_ptr(), 0 if aux is None else aux.stride(0),
            get_kernel_config().cpu_avx2_kernels))
        return h, residual
