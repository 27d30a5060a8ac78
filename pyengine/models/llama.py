"""The Llama family (Llama 2/3, SmolLM, Qwen2 with qkv bias, Qwen3 with per-head q/k RMSNorm).

One flat token batch [T] runs through the decoder layers (pyengine.models.layers.LlamaDecoderLayer);
each appends its new K/V to the paged cache and attends over it. Weights are [in, out] (see
docs/models.md for why); a tied lm_head is kept only once, as [hidden, vocab], and token embedding
then gathers its columns (on the CPU, once packed, from the packed codes where its values allow).
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from pyengine import ops
from pyengine.config import ModelConfig, architecture_of
from pyengine.engine.attention_metadata import AttentionMetadata
from pyengine.models.layers import (KVCache, LlamaDecoderLayer, RotaryEmbedding, cpu_linear_packer, linear,
                                    one_torch_thread, onednn_prepack, pack_weights, param)
from pyengine.ops.kernel_config import get_kernel_config

if TYPE_CHECKING:
    from pyengine.models.llama_cpu_stack import CpuLlamaStack


def llama_model_config(cfg: dict[str, Any]) -> ModelConfig:
    arch = architecture_of(cfg)
    config = ModelConfig.from_hf_dict(cfg)
    # Qwen2 always has q/k/v bias (its config has no attention_bias key); Qwen3 norms q and k per head.
    config.attention_bias = config.attention_bias or arch == "Qwen2ForCausalLM"
    config.qk_norm = arch == "Qwen3ForCausalLM"
    return config


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        vocab, hidden = config.vocab_size, config.hidden_size
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, dtype) for _ in range(config.num_hidden_layers))
        self.norm = param(hidden, dtype=dtype)
        self.lm_head = param(hidden, vocab, dtype=dtype)  # [in, out]
        # Untied: a row-major [vocab, hidden] table. Tied: None, rows come from lm_head's columns.
        self.embed_tokens = None if config.tie_word_embeddings else param(vocab, hidden, dtype=dtype)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.head_dim, config.rope_theta, config.rope_scaling,
                                          dtype, max_positions=config.max_position_embeddings)
        # Set by prepack_for_cpu: the packed lm_head, and every layer in one C++ call per step.
        self.packed_lm_head: Any = None
        self.cpu_stack: CpuLlamaStack | None = None
        # A tied lm_head whose dense copy went once packed: token embedding reads these instead
        # (PackedColumns: the packed lm_head's own codes; Int8Columns where another packer ran).
        self.embedding_columns: PackedColumns | Int8Columns | None = None
        self._cpu_pack: Any = None  # the packer load_weights(prepack_cpu=True) used
        # EAGLE-3 (set_aux_layers): the layers whose input stream a forward keeps, and the last one's
        self.aux_layers: tuple[int, ...] | None = None
        self.last_aux: torch.Tensor | None = None
        self.aux_out: torch.Tensor | None = None

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[KVCache],
    ) -> torch.Tensor:
        """input_ids/positions [T] int64 -> final-norm hidden states [T, hidden]. With aux layers
        set (set_aux_layers), the residual streams at their inputs go to last_aux as well."""
        h = self.embed(input_ids)
        aux: dict[int, torch.Tensor] | None = None if self.aux_layers is None else {}
        stack = self.cpu_stack
        config = get_kernel_config()
        rotary = self.rotary_emb
        use_stack = stack is not None and config.cpu_layer_stack and stack.applies(meta, kv_caches)
        layers = self.aux_layers or ()
        if (use_stack and config.cpu_kernels and rotary.cos_table is not None
                and rotary.cos_table.dtype == stack.dtype):
            # The whole step in one C++ call: the rotary rows looked up, the final fused add + norm
            # applied and the aux states kept there (the same C++ ops and bits as below, fewer
            # Python ops per step).
            states = self._aux_states(h.shape[0]) if layers else None
            out = stack(h, rotary.cos_table, rotary.sin_table, meta, kv_caches, positions, self.norm, layers, states)[0]
            if states is not None:
                self.last_aux = states
            return out
        cos, sin = rotary(positions)  # [T, D], shared by all heads and layers
        if use_stack:
            states = self._aux_states(h.shape[0]) if layers else None
            h, residual = stack(h, cos, sin, meta, kv_caches, aux_layers=layers, aux=states)
            if states is not None:  # the stream before the final norm is the caller's h + residual
                for j in (j for j, i in enumerate(layers) if i == len(self.layers)):
                    states[:, j * h.shape[1]:(j + 1) * h.shape[1]] = h + residual
                self.last_aux, aux = states, None
        else:
            residual = None
            for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
                if aux is not None and i in self.aux_layers:
                    aux[i] = h.clone() if residual is None else h + residual  # the layer adds in place
                h, residual = layer(h, residual, cos, sin, meta, kv_cache)
        assert residual is not None
        if aux is not None:  # the per-layer loop's
            if len(self.layers) in self.aux_layers:
                aux[len(self.layers)] = h + residual
            self._store_aux(aux)
        return ops.fused_add_rms_norm(h, residual, self.norm, self.config.rms_norm_eps)[0]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings [T, hidden] (an EAGLE-3 head without its own table reads them too)."""
        if self.embedding_columns is not None:
            return self.embedding_columns.gather(input_ids)
        if self.embed_tokens is None:
            return self.lm_head.index_select(1, input_ids).t().contiguous()
        return F.embedding(input_ids, self.embed_tokens)

    # ---- EAGLE-3: the residual stream at the input of a few layers (pyengine/models/eagle3.py) ----
    def set_aux_layers(self, layers: tuple[int, ...] | None, max_graph_tokens: int = 0) -> None:
        """From now on every forward also keeps the residual stream at the input of each layer in
        `layers` (0: the embeddings, num_layers: before the final norm), concatenated in that order
        as last_aux [T, len(layers) * hidden]. A step of at most max_graph_tokens tokens writes it
        into aux_out, a buffer of fixed address, so that a captured CUDA graph's replay refreshes it."""
        if layers is not None and not all(0 <= i <= len(self.layers) for i in layers):
            raise ValueError(f"aux hidden-state layers {layers} must be in 0..{len(self.layers)}")
        self.aux_layers = layers
        self.last_aux = None
        self.aux_out = None
        if layers is not None and max_graph_tokens > 0:
            self.aux_out = torch.zeros(max_graph_tokens, len(layers) * self.config.hidden_size, dtype=self.dtype,
                                       device=self.norm.device)

    def _aux_states(self, num_tokens: int) -> torch.Tensor:
        """Where a step's aux states go: aux_out's first rows where they fit (a graph's replay
        reads them there), else a new tensor."""
        out = self.aux_out
        if out is not None and num_tokens <= out.shape[0]:
            return out[:num_tokens]
        return torch.empty(num_tokens, len(self.aux_layers) * self.config.hidden_size, dtype=self.dtype,
                           device=self.norm.device)

    def _store_aux(self, aux: dict[int, torch.Tensor]) -> None:
        states = torch.cat([aux[i] for i in self.aux_layers], dim=-1)
        out = self.aux_out
        if out is not None and states.shape[0] <= out.shape[0]:
            out[:states.shape[0]].copy_(states)
            states = out[:states.shape[0]]
        self.last_aux = states

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] float32."""
        return linear(hidden, self.lm_logits_weight).float()

    @property
    def lm_logits_weight(self) -> Any:
        return self.lm_head if self.packed_lm_head is None else self.packed_lm_head

    def prepack_for_cpu(self) -> bool:
        """Swap every linear weight for a packed copy (CPU only, after load_weights): on x86-64 CPUs
        with AVX-512 (avx512_bf16 for bf16) or AVX2 + FMA pyengine's own GEMM
        (pyengine.ops.cpu.PackedLinear: batch-invariant), which also runs the C++ layer stack,
        else a oneDNN-prepacked weight. Returns False (model unchanged)
        where neither is available. The dense copies are dropped, so load_weights cannot run again.
        What load_weights(prepack_cpu=True) packed already stays as it is."""
        if self.lm_head.device.type != "cpu":
            return False
        pack = self._cpu_pack or cpu_linear_packer(self.lm_head)
        if pack is None:
            return False
        for layer in self.layers:
            layer.pack(pack)  # what load_weights(prepack_cpu=True) packed already stays as it is
        if self.packed_lm_head is None:
            self._pack_lm_head(pack)
        self.owns_cpu_threads = pack is not onednn_prepack  # see ModelRunner.step_threads
        if self.owns_cpu_threads:  # used per step while KernelConfig.cpu_layer_stack is on
            from pyengine.models.llama_cpu_stack import CpuLlamaStack  # needs the extension's CPU ops

            self.cpu_stack = CpuLlamaStack.build(self.layers, self.config, self.dtype)
        return True

    def _pack_lm_head(self, pack: Any) -> None:
        """Pack lm_head; its dense copy goes, unless tied and token embedding must gather from it
        (values that neither the packed codes nor Int8Columns give back exactly)."""
        self.packed_lm_head = pack(self.lm_head.detach())
        if self.embed_tokens is None:
            w = self.lm_head.detach()
            self.embedding_columns = PackedColumns.of(self.packed_lm_head, w) or Int8Columns.of(w)
            if self.embedding_columns is None:
                return
        self.lm_head.data = torch.empty(0, dtype=self.dtype)

    def _place(self, name: str, tensor: torch.Tensor, put: Any) -> None:
        """load_weights: where one HF-named tensor goes (put(target, name, tensor, start, rows))."""
        cfg = self.config
        hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        inter = cfg.intermediate_size
        # (row offset, row count) of each HF projection inside its fused parameter.
        qkv_rows = {"q_proj": (0, hq * d), "k_proj": (hq * d, hkv * d), "v_proj": ((hq + hkv) * d, hkv * d)}
        gate_up_rows = {"gate_proj": (0, inter), "up_proj": (inter, inter)}
        qk_norm_rows = {"q_norm": (0, hq), "k_norm": (hq, hkv)}
        if name.endswith("rotary_emb.inv_freq"):
            return  # derived from the config, never trusted from a file
        parts = name.split(".")
        if name == "model.embed_tokens.weight":
            put(self.lm_head if self.embed_tokens is None else self.embed_tokens, name, tensor)
        elif name == "model.norm.weight":
            put(self.norm, name, tensor)
        elif name == "lm_head.weight":
            if not cfg.tie_word_embeddings:
                put(self.lm_head, name, tensor)
        elif len(parts) >= 5 and parts[0] == "model" and parts[1] == "layers":
            layer = self.layers[int(parts[2])]
            assert isinstance(layer, LlamaDecoderLayer)
            module, kind = parts[-2], parts[-1]
            if module in qkv_rows:
                put(layer.qkv_proj if kind == "weight" else layer.qkv_bias, name, tensor, *qkv_rows[module])
            elif module in gate_up_rows:
                put(layer.gate_up_proj, name, tensor, *gate_up_rows[module])
            elif module in qk_norm_rows:
                start, rows = qk_norm_rows[module]
                # One per-head weight [D], repeated for every head of q (or k).
                put(layer.qk_norm, name, tensor.expand(rows, d), start, rows)
            elif module in ("o_proj", "down_proj", "input_layernorm", "post_attention_layernorm"):
                put(getattr(layer, module), name, tensor)
            else:
                raise ValueError(f"unexpected checkpoint tensor {name}")
        else:
            raise ValueError(f"unexpected checkpoint tensor {name}")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], adopt: bool = False,
                     prepack_cpu: bool = False) -> None:
        """Copy HF-named tensors ([out, in] linears) into the fused, transposed parameters; every
        parameter must be fully covered, else ValueError.

        adopt: the tensors are the caller's to give away: one that fills a whole parameter and
        already has its layout (a linear's: the transposed view of an [in, out] array) becomes
        that parameter's storage instead of being copied. prepack_cpu: on the CPU, each decoder
        linear is packed as prepack_for_cpu packs it as soon as all its rows are in, and its dense
        copy dropped, so that only the linears of the layer being loaded are ever dense at once
        (prepack_for_cpu then does the rest)."""
        transposed = {id(self.lm_head)}
        linears: dict[int, tuple[nn.Module, str]] = {}  # parameter id -> (layer, name): packed once loaded
        for layer in self.layers:
            for name in LlamaDecoderLayer.LINEAR_NAMES:
                linears[id(getattr(layer, name))] = (layer, name)
        transposed.update(linears)
        # A loader may have packed some linears already (loader/gguf_codes.py), lm_head included.
        pack = (self._cpu_pack or cpu_linear_packer(self.lm_head)) if prepack_cpu and self.lm_head.device.type == "cpu" else None
        self._cpu_pack = pack
        filled: dict[int, int] = {}  # parameter id -> HF rows copied so far
        spares: dict[tuple[int, ...], torch.Tensor] = {}  # a packed linear's dense storage, for the next layer's
        expected = {id(p): (pname, p.shape[1] if id(p) in transposed else p.shape[0])
                    for pname, p in self.named_parameters() if not (p is self.lm_head and self.packed_lm_head is not None)}

        def put(target: Any, name: str, src: torch.Tensor, start: int = 0, rows: int | None = None) -> None:
            if target is None:
                raise ValueError(f"checkpoint tensor {name} has no place in this model config")
            if not isinstance(target, nn.Parameter):  # packed already: this weight came before
                raise ValueError(f"checkpoint tensor {name} appears twice")
            hf_view = target.t() if id(target) in transposed else target  # HF [out, in] orientation
            dst = hf_view if rows is None else hf_view.narrow(0, start, rows)
            if tuple(dst.shape) != tuple(src.shape):
                raise ValueError(f"{name}: checkpoint shape {tuple(src.shape)} != expected {tuple(dst.shape)}")
            if adopt and rows is None and _same_layout(src, dst):
                target.data = src.t() if id(target) in transposed else src
            else:
                if id(target) not in filled and tuple(target.shape) in spares:  # pages already mapped
                    target.data = spares.pop(tuple(target.shape))
                    hf_view = target.t() if id(target) in transposed else target
                    dst = hf_view if rows is None else hf_view.narrow(0, start, rows)
                with torch.no_grad(), one_torch_thread():
                    dst.copy_(src)
            filled[id(target)] = filled.get(id(target), 0) + dst.shape[0]
            if pack is not None and filled[id(target)] == hf_view.shape[0]:
                if id(target) in linears:
                    layer, linear_name = linears[id(target)]
                    pack_weights(layer, (linear_name,), pack)
                    spares[tuple(target.shape)] = target.data
                elif target is self.lm_head:
                    self._pack_lm_head(pack)

        for name, tensor in weights:
            self._place(name, tensor, put)
            del tensor  # not kept alive while the next one is made

        for pid, (pname, rows) in expected.items():
            if filled.get(pid, 0) != rows:
                raise ValueError(f"checkpoint does not cover parameter {pname} ({filled.get(pid, 0)}/{rows} rows)")


def _same_layout(src: torch.Tensor, dst: torch.Tensor) -> bool:
    """Whether src could stand for dst as is: same dtype, device, shape and strides, and the
    whole of its own storage."""
    return (src.dtype == dst.dtype and src.device == dst.device and src.shape == dst.shape
            and src.stride() == dst.stride() and src.storage_offset() == 0
            and src.untyped_storage().nbytes() == src.numel() * src.element_size())


class PackedColumns:
    """The rows of a tied token embedding read from the packed lm_head's own codes
    (PackedLinear.columns), so its codes are held once for both the logits and the embeddings.
    From a GGUF Q8_0 table (loader/gguf_codes.py) the values are d * q, the dequantised ones, by
    construction; of() checks every bit of a table packed from float32 values."""

    def __init__(self, packed: Any) -> None:
        self.packed = packed  # PackedLinear [hidden, vocab] in a 4- or 8-bit format

    @staticmethod
    def of(packed: Any, w: torch.Tensor, chunk: int = 4096) -> PackedColumns | None:
        """A view of packed (made from w [hidden, vocab]) that gives w's columns back bit for bit
        (signed zeros included), or None."""
        columns = getattr(packed, "columns", None)
        if columns is None or w.dtype != torch.float32 or w.dim() != 2:
            return None
        for c0 in range(0, w.shape[1], chunk):
            got = columns(torch.arange(c0, min(c0 + chunk, w.shape[1])))
            if got is None or not torch.equal(got.view(torch.int32), w[:, c0:c0 + chunk].t().contiguous().view(torch.int32)):
                return None
        return PackedColumns(packed)

    def gather(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ids of the embedding: [T, hidden] float32, as lm_head.index_select(1, ids).t()."""
        return self.packed.columns(ids)


class Int8Columns:
    """The columns of a float32 [hidden, vocab] lm_head (the rows of a tied token embedding) as
    int8 codes q (same layout) and one float32 scale s per column and run of 32 rows: exact for
    a GGUF Q8_0 table, whose values are q * s with s = max|w| / 127 per run (an fp16 s times an
    int8 q: exact in float32), in 1.1 bytes a value instead of 4. gather() rebuilds bit for bit."""

    RUN = 32

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor) -> None:
        self.codes, self.scales = codes, scales  # [hidden / 32, 32, vocab] int8, [hidden / 32, 1, vocab]

    @staticmethod
    def of(w: torch.Tensor, chunk: int = 1024) -> Int8Columns | None:
        """w's values as codes and scales, or None where one is not q * s exactly (every bit is
        compared, signed zeros included)."""
        hidden, vocab = w.shape
        if w.dtype != torch.float32 or hidden % Int8Columns.RUN or not w.numel() or not w.is_contiguous():
            return None
        runs = w.view(hidden // Int8Columns.RUN, Int8Columns.RUN, vocab)
        codes = torch.empty(runs.shape, dtype=torch.int8)
        scales = torch.empty(runs.shape[0], 1, vocab, dtype=torch.float32)
        with one_torch_thread():
            for c0 in range(0, vocab, chunk):
                v = runs[:, :, c0:c0 + chunk]
                s = v.abs().amax(dim=1, keepdim=True) / 127
                q = v.div(torch.where(s > 0, s, 1.0)).round_().add_(0.0)  # + 0: no -0 code (int8 has none)
                codes[:, :, c0:c0 + chunk] = q  # |q| <= 127, as |v| <= 127 s
                scales[:, :, c0:c0 + chunk] = s
                if not torch.equal(q.mul_(s).view(torch.int32), v.view(torch.int32)):
                    return None
        return Int8Columns(codes, scales)

    def gather(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ids of the embedding: [T, hidden] float32, as lm_head.index_select(1, ids).t()."""
        q = self.codes.index_select(2, ids).float().mul_(self.scales.index_select(2, ids))
        return q.view(-1, ids.shape[0]).t().contiguous()
