"""A CPU step through all of a Llama model's decoder layers in one C++ call
(csrc/cpu/cpu_llama_stack.h: the same ops as LlamaDecoderLayer.forward, in the same order, on the same
values; hidden states equal bit for bit). It saves the per-op Python crossings, checks and
allocations, ~2 ms of a 7 ms SmolLM2 decode step at batch 1 on 2 cores.

Taken when the model's linears are pyengine's PackedLinear, the layers have no qkv bias or q/k
norm, and the step's attention is one the C++ kernel runs (pyengine.ops.cpu.paged_attention's
rule: long prefills keep the op-by-op path and its SDPA reference).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pyengine.engine.attention_metadata import AttentionMetadata

if TYPE_CHECKING:
    from pyengine.models.llama import LlamaForCausalLM

KVCache = tuple[torch.Tensor, torch.Tensor]
_DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1}


class CpuLlamaStack:
    def __init__(self, model: LlamaForCausalLM) -> None:
        from pyengine.ops import cpu as cpu_ops

        self._cpu = cpu_ops
        cfg = model.config
        self.dtype = model.dtype
        layers = []  # raw pointers into weights the model (which holds this stack) owns
        for layer in model.layers:
            linears = [getattr(layer, name) for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")]
            layers.append((*(w.packed for w in linears), layer.input_layernorm.data_ptr(),
                           layer.post_attention_layernorm.data_ptr()))
        self._stack = cpu_ops._K.LlamaStack(layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                                            cfg.head_dim, cfg.intermediate_size, cfg.rms_norm_eps,
                                            model.layers[0].scale, _DTYPE_CODE[model.dtype])

    @staticmethod
    def build(model: LlamaForCausalLM) -> CpuLlamaStack | None:
        """The stack for a prepacked CPU model, or None where a layer needs the op-by-op path."""
        from pyengine.models.llama import LlamaDecoderLayer

        try:
            from pyengine.ops.cpu import PackedLinear
        except ImportError:
            return None
        if model.dtype not in _DTYPE_CODE or model.config.head_dim % 16:
            return None
        for layer in model.layers:
            if not isinstance(layer, LlamaDecoderLayer) or layer.qkv_bias is not None or layer.qk_norm is not None:
                return None
            if not all(isinstance(getattr(layer, n, None), PackedLinear) and getattr(layer, n).dtype == model.dtype
                       for n in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")):
                return None
        return CpuLlamaStack(model)

    def applies(self, meta: AttentionMetadata, kv_caches: list[KVCache]) -> bool:
        """Whether the C++ attention takes this step (else the op-by-op path runs it)."""
        if meta.num_tokens == 0 or kv_caches[0][0].dtype != self.dtype:
            return False
        return self._cpu.step_tables(meta)[3] <= self._cpu.MAX_QUERY_KEY_PAIRS

    def __call__(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                 kv_caches: list[KVCache]) -> tuple[torch.Tensor, torch.Tensor]:
        """Embeddings h [T, hidden] -> (last layer's MLP output, residual stream), as the layer loop
        of LlamaForCausalLM.forward returns them."""
        if len(kv_caches) != self._stack.num_layers:
            raise ValueError(f"{len(kv_caches)} KV caches for {self._stack.num_layers} layers")
        k0 = kv_caches[0][0]
        for k, v in kv_caches:
            if k.shape != k0.shape or v.shape != k0.shape or not (k.is_contiguous() and v.is_contiguous()):
                raise ValueError(f"every layer's K/V cache must be contiguous {tuple(k0.shape)}")
        bt, qsl, ctx, _ = self._cpu.step_tables(meta)
        h = h.contiguous()
        residual = torch.empty_like(h)
        cos, sin = cos.to(self.dtype).contiguous(), sin.to(self.dtype).contiguous()
        slots = meta.slot_mapping.contiguous()
        self._cpu._raise(self._stack.forward(
            h.data_ptr(), residual.data_ptr(), h.shape[0], cos.data_ptr(), sin.data_ptr(), slots.data_ptr(),
            bt.data_ptr(), bt.shape[1], qsl.data_ptr(), ctx.data_ptr(), ctx.shape[0],
            [k.data_ptr() for k, _ in kv_caches], [v.data_ptr() for _, v in kv_caches], k0.shape[1], k0.shape[0],
            torch.get_num_threads() == 1))
        return h, residual
