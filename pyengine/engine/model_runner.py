"""Owns the model's paged KV cache and runs one forward over a scheduled batch."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import torch
from torch import nn

from pyengine.engine.attention_metadata import AttentionMetadata
from pyengine.engine.host_arrays import to_device
from pyengine.models.layers import one_torch_thread
from pyengine.config import ModelConfig

class ModelRunner:
    def __init__(self, model: nn.Module, config: ModelConfig, block_size: int, num_kv_blocks: int,
                 device: torch.device, dtype: torch.dtype, max_model_len: int | None = None,
                 max_num_seqs: int = 256, max_query_len: int = 1, cuda_graphs: bool = False,
                 num_state_slots: int = 0, num_state_checkpoints: int = 0, prefill_graph_tokens: int = 0) -> None:
        self.model, self.config, self.block_size = model, config, block_size
        self.device, self.dtype, self.num_kv_blocks = device, dtype, num_kv_blocks
        # Unwritten slots are never read: attention reads only positions below each row's context.
        self.kv_caches: list = []
        if hasattr(model, "make_kv_caches"):  # a cache layout of its own (MLA: one latent row per token)
            self.kv_caches = model.make_kv_caches(num_kv_blocks, block_size, device)
        else:
            shape = (num_kv_blocks, block_size, config.num_key_value_heads, config.head_dim)
            self.kv_caches = [(torch.empty(shape, dtype=dtype, device=device),
                               torch.empty(shape, dtype=dtype, device=device)) for _ in range(config.num_hidden_layers)]
        # A proposer that reads the target's hidden states (MTP) sets keep_hidden; execute() then
        # leaves every token's final hidden state of the step in last_hidden.
        self.keep_hidden = False
        self.keep_aux = False  # keep_aux_hidden: last_hidden holds the model's aux states instead (EAGLE-3)
        self.last_hidden: torch.Tensor | None = None
        self.last_rows: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        # ---- CUDA graphs (pyengine/cuda_graph_runner.py): decode/verify steps; the rest eager ----
        self.graph_runner = None
        self.last_graph_key: tuple[int, int] | None = None  # the graph the last execute() replayed
        if cuda_graphs and max_model_len is not None:
            from pyengine.engine.cuda_graph_runner import CudaGraphRunner
            from pyengine.engine.graph_capture import graphs_supported

            ok, _ = graphs_supported(model, config, dtype, device)
            if ok:
                self.graph_runner = CudaGraphRunner(model, self.kv_caches, block_size, device, max_num_seqs,
                                                    max_query_len, max_model_len + max_query_len + block_size,
                                                    prefill_tokens=prefill_graph_tokens)

        # ---- recurrent state (hybrid models, pyengine/state_cache.py): only when the model declares it ----
        self.state_cache = None
        if hasattr(model, "state_shapes"):
            from pyengine.engine.state_cache import StateCache

            if num_state_slots <= 0:
                raise ValueError(f"{config.architecture} keeps recurrent state: num_state_slots must be > 0")
            self.state_cache = StateCache(model.state_shapes(max_query_len - 1), num_state_slots, dtype, device,
                                          num_spec_tokens=max_query_len - 1, num_checkpoints=num_state_checkpoints)
            if self.graph_runner is not None:  # captured decode/verify steps read the slots from static buffers
                self.graph_runner.state_cache = self.state_cache
        # ---- end recurrent state ----

    @contextlib.contextmanager
    def step_threads(self) -> Iterator[None]:
        """Around one engine step: a CPU model whose linears run pyengine's GEMM (its own thread
        pool, see pyengine.ops.cpu.PackedLinear) keeps torch at one thread meanwhile. Otherwise a
        torch op of the step (e.g. the logits cast) wakes torch's OpenMP workers, which then spin
        for milliseconds on the cores the GEMM threads need: decode GEMMs ran 1.8x slower."""
        if self.device.type != "cpu" or not getattr(self.model, "owns_cpu_threads", False):
            yield
            return
        with one_torch_thread():
            yield

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        return to_device(array, self.device)

    def build_metadata(self, batch) -> AttentionMetadata:  # batch: pyengine._C.ScheduledBatch
        return AttentionMetadata(
            slot_mapping=self._tensor(batch.slot_mapping),
            block_tables=self._tensor(batch.block_tables),
            query_start_loc=self._tensor(batch.query_start_loc),
            context_lens=self._tensor(batch.context_lens),
            max_query_len=int(batch.max_query_len),
            max_context_len=int(batch.max_context_len),
            block_size=self.block_size,
        )

    def keep_aux_hidden(self, layers: tuple[int, ...]) -> None:
        """Keep, instead of the final hidden states, the residual stream at the input of these
        layers, concatenated per token (an EAGLE-3 head reads them; the model's set_aux_layers).
        Graph-replayed steps refresh them too: they land in a buffer the graphs write."""
        if not hasattr(self.model, "set_aux_layers"):
            raise ValueError(f"{self.config.architecture}: this model cannot give its intermediate hidden states "
                             "(EAGLE-3 needs a Llama-family target)")
        self.model.set_aux_layers(layers, self.graph_runner.T if self.graph_runner is not None else 0)
        self.keep_hidden = self.keep_aux = True

    def _keep(self, batch, hidden: torch.Tensor | None) -> None:
        """The step's final hidden states (or aux states: keep_aux) with the rows they belong to:
        seq ids, first positions, query starts (a proposer that reads them: MTP, EAGLE-3)."""
        if self.keep_aux and hidden is not None:
            aux = self.model.aux_out if self.last_graph_key is not None else self.model.last_aux
            hidden = aux[:hidden.shape[0]]
        self.last_hidden = hidden
        self.last_rows = (np.array(batch.seq_ids), np.array(batch.num_computed), np.array(batch.query_start_loc))

    def hold_hidden(self) -> None:
        """A step is about to be launched ahead (async decode): its replay overwrites the graphs'
        static hidden / aux buffers, which last_hidden views and the proposer reads only in the next
        step. Keep a copy, ordered on the stream before that replay."""
        if self.keep_hidden and self.last_hidden is not None:
            self.last_hidden = self.last_hidden.clone()

    def adopt_launched(self, batch, key: tuple[int, int]) -> None:
        """The step launched ahead is `batch` (PendingStep.matches): its forward stands for execute(),
        so its hidden states are the last step's."""
        self.last_graph_key = key
        if self.keep_hidden:
            self._keep(batch, self.graph_runner.last_hidden)

    @torch.inference_mode()
    def execute(self, batch, token_patch: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Forward over every scheduled token; returns logits [len(logits_indices), vocab] fp32.
        token_patch: (token indices, ids) on the device that replace the batch's input ids there
        (drafts still on the device: spec_decode/device_drafts.py); they lie in decode rows."""
        self.last_graph_key = None
        patch = () if token_patch is None else (token_patch,)  # passed on only if given: wrappers keep their signatures
        if self.state_cache is not None:  # prefix caching: checkpoint saves and restores come first
            self.state_cache.apply_copies(batch)
        if self.graph_runner is not None:
            g = self.graph_runner
            key = g.bucket_for(batch)
            if key is None and int(batch.num_decode_rows) < len(batch.context_lens):
                key = g.prefill_key_for(batch)  # a step with prefill rows: one prefill graph (None: eager)
            if key is not None:
                self.last_graph_key = key
                logits = g.execute(batch, key, *patch)
                if self.keep_hidden:
                    self._keep(batch, g.last_hidden)
                return logits
        meta = self.build_metadata(batch)
        input_ids = self._tensor(batch.input_ids)
        if token_patch is not None:
            input_ids = input_ids.index_copy(0, *token_patch)
        positions = self._tensor(batch.positions)
        if self.state_cache is None:
            hidden = self.model(input_ids, positions, meta, self.kv_caches)
        else:  # hybrid: per-row state slots, accepted counts and query lengths (decode rows first)
            state = self.state_cache.prepare(batch, meta.query_start_loc)
            hidden = self.model(input_ids, positions, meta, self.kv_caches, state=state)
        if self.keep_hidden:
            self._keep(batch, hidden)
        rows = batch.logits_indices
        if len(rows) == hidden.shape[0] and (len(rows) == 0 or rows[-1] == len(rows) - 1):
            return self.model.compute_logits(hidden)  # every row in order (increasing indices): no gather
        index = self._tensor(np.asarray(rows, dtype=np.int64))
        return self.model.compute_logits(hidden.index_select(0, index))
