"""A drafting layer's chained draft steps as one CUDA graph (MTP layer, EAGLE-3 head; greedy rows).

After its catch-up, a drafting row feeds draft j at position p + j (p = n - 2: the position of the
last committed token's predecessor) with the layer's own previous output as the hidden state, and
draws draft j + 1 from that forward's logits. Every input but the tokens and hidden states is known
before the chain starts: positions, KV slots (in the blocks the previous step reserved) and context
lengths. So one host-to-device copy stages all steps' metadata and one replay runs steps forwards,
each followed by its argmax on the device, instead of steps x (stage, replay, draw) from the host.
Greedy rows only: a random row's q must be kept per draft (MtpProposer's per-step path does that).

For the device loop (layer_device_drafts.py) a row's first position is known on the host only up
to its accepted count a, which is on the device, and draft 1 is not drawn yet: run_from_state()
stages the positions for a = 0, and its graphs (keyed (b, steps, "state")) move them, their slots
and context lengths by a and draw draft 1 from the layer's state after the bonus token (greedy)
before the chain, so that the host launches one replay.

Graphs are keyed (bucket b, steps), captured on first use in HeadGraphs' memory pool. Row i of b
takes part in step j only while j < steps_i: a finished or padding row's step has slot -1 (no KV
write) and context 0 (no key read), and its token is dropped. On a CPU device the same static
buffers run eagerly (tests).
"""
from __future__ import annotations

import numpy as np
import torch

from pyengine.engine.attention_metadata import AttentionMetadata
from pyengine.engine.graph_capture import capture_graph
from pyengine.ops import streams
from pyengine.ops.kernel_config import get_kernel_config, use_kernel_config


class DraftChain:
    def __init__(self, layer, kv_cache, block_size: int, device: torch.device, buckets: list[int], width: int,
                 max_steps: int, hidden: tuple[int, torch.dtype], pool) -> None:
        self.layer, self.kv_cache, self.block_size, self.device = layer, kv_cache, block_size, device
        self.buckets, self.width, self.max_steps = buckets, width, max_steps
        R, S, W = buckets[-1], max_steps, width
        self.use_graphs = device.type == "cuda"
        self.kernel_config = get_kernel_config()
        self.pool = pool
        # staged per chain: int64 [positions S x R | slots S x R], int32 [context S x R | tables R x W]
        self.n64, self.n32 = 2 * S * R, S * R + R * W
        pin = self.use_graphs
        self.host_bytes = torch.zeros(8 * self.n64 + 4 * self.n32, dtype=torch.uint8, pin_memory=pin)
        self.dev_bytes = torch.zeros_like(self.host_bytes, device=device)
        h64, h32 = self._split(self.host_bytes)
        self.h64, self.h32 = h64.numpy(), h32.numpy()
        d64, d32 = self._split(self.dev_bytes)
        self.positions, self.slots = d64[:S * R].view(S, R), d64[S * R:].view(S, R)
        self.context, self.tables = d32[:S * R].view(S, R), d32[S * R:].view(R, W)
        self.query_start_loc = torch.arange(R + 1, dtype=torch.int32, device=device)
        self.first_ids = torch.zeros(R, dtype=torch.int64, device=device)  # draft 1 of each row
        self.first_hidden = torch.zeros(R, hidden[0], dtype=hidden[1], device=device)  # its input state
        self.shift = torch.zeros(R, dtype=torch.int64, device=device)  # run_from_state: each row's a
        self.copy_done = torch.cuda.Event() if self.use_graphs else None
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph | None, torch.Tensor]] = {}

    def _split(self, buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        off = 8 * self.n64
        return buf[:off].view(torch.int64), buf[off:].view(torch.int32)

    def fits(self, rows: int, tables: np.ndarray, steps: int) -> bool:
        return 0 < rows <= self.buckets[-1] and 0 < steps <= self.max_steps and tables.shape[1] <= self.width

    def prepare(self, rows: int, steps: int) -> None:
        """Capture the graph run_from_state replays for `rows` rows and `steps` steps, if not yet."""
        key = self._key(rows, steps, "state")
        if self.use_graphs and key not in self.graphs:
            self.graphs[key] = self._capture(key)

    @torch.inference_mode()
    def capture_all(self, state_rows: int) -> int:
        """Capture every chain graph not captured yet (start-up, as CudaGraphRunner.capture_all):
        each bucket and depth 1..max_steps, and run_from_state's for buckets of at most state_rows
        rows (the device loop's). Returns how many were captured."""
        if not self.use_graphs:
            return 0
        keys = [(b, s) for b in self.buckets for s in range(1, self.max_steps + 1)]
        keys += [(b, s, "state") for b in self.buckets if b <= state_rows for s in range(1, self.max_steps + 1)]
        missing = [key for key in keys if key not in self.graphs]
        for key in missing:
            self.graphs[key] = self._capture(key)
        return len(missing)

    def run_from_state(self, tables: np.ndarray, first_pos: np.ndarray, steps_per_row: np.ndarray,
                       shift: torch.Tensor) -> torch.Tensor:
        """The device loop's drafts of greedy rows, one replay: row i's draft 1 is the argmax of
        the layer's logits on first_hidden[i] (the caller writes it), then as run() from position
        first_pos[i] + shift[i] (shift on the device; every such position must lie in the row's
        blocks). Returns [1 + steps, rows]: draft 1, then the chain's (a static buffer)."""
        key = self._key(len(first_pos), int(steps_per_row.max()), "state")
        return self._replay(key, tables, first_pos, steps_per_row, lambda rows: self.shift[:rows].copy_(shift))

    def run(self, tables: np.ndarray, first_pos: np.ndarray, steps_per_row: np.ndarray, first_ids: torch.Tensor,
            first_hidden: torch.Tensor) -> torch.Tensor:
        """Drafts 2.. of each row: row i (block table tables[i]) feeds first_ids[i] with
        first_hidden[i] at position first_pos[i], then its own argmax, steps_per_row[i] times in
        all. Returns the drawn tokens [steps, rows] (device int64, a static buffer valid until the
        next run); entry (j, i) is meaningful for j < steps_per_row[i]."""
        def fill(rows: int) -> None:
            self.first_ids[:rows].copy_(first_ids)
            self.first_hidden[:rows].copy_(first_hidden)
        return self._replay(self._key(len(first_pos), int(steps_per_row.max())), tables, first_pos, steps_per_row,
                            fill)

    def _key(self, rows: int, steps: int, *mode: str) -> tuple:
        return (next(x for x in self.buckets if x >= rows), steps, *mode)

    @torch.inference_mode()
    def _replay(self, key: tuple, tables: np.ndarray, first_pos: np.ndarray, steps_per_row: np.ndarray,
                fill) -> torch.Tensor:
        """Capture key's graph if new, stage the rows' steps, fill(rows) the device inputs the
        staging does not carry, replay (CPU: run eagerly); the drawn tokens [.., rows]."""
        rows = len(first_pos)
        if self.use_graphs and key not in self.graphs:
            self.graphs[key] = self._capture(key)  # stages padding: the rows are staged after it
        self._stage(tables, first_pos.astype(np.int64), steps_per_row.astype(np.int64), key[1])
        self._copy()
        fill(rows)
        if self.use_graphs:
            graph, tokens = self.graphs[key]
            graph.replay()
        else:
            tokens = self._forward(key)
        return tokens[:, :rows]

    def _stage(self, tables: np.ndarray, first_pos: np.ndarray, steps_per_row: np.ndarray, steps: int) -> None:
        """Every step's positions, slots and context lengths (padding: slot -1, context 0)."""
        if self.copy_done is not None:
            self.copy_done.synchronize()  # the last chain's copy has left the staging buffer
        R, S, B = self.buckets[-1], self.max_steps, self.block_size
        rows = len(first_pos)
        pos = self.h64[:S * R].reshape(S, R)
        slots = self.h64[S * R:].reshape(S, R)
        ctx = self.h32[:S * R].reshape(S, R)
        pos[:steps] = 0
        slots[:steps] = -1
        ctx[:steps] = 0
        p = first_pos[None, :] + np.arange(steps)[:, None]  # [steps, rows]
        live = np.arange(steps)[:, None] < steps_per_row[None, :]
        blocks = np.take_along_axis(tables, np.minimum(p // B, tables.shape[1] - 1).T, axis=1).T
        assert (blocks[live] >= 0).all(), "a chained draft's position lies past the row's reserved blocks"
        pos[:steps, :rows] = np.where(live, p, 0)
        slots[:steps, :rows] = np.where(live, blocks.astype(np.int64) * B + p % B, -1)
        ctx[:steps, :rows] = np.where(live, p + 1, 0)
        tab = self.h32[S * R:].reshape(R, self.width)
        tab[:rows, :tables.shape[1]] = tables
        tab[:rows, tables.shape[1]:] = -1

    def _copy(self) -> None:
        if self.use_graphs:
            streams.copy_async(self.dev_bytes, self.host_bytes, self.device, self.copy_done)
        else:
            self.dev_bytes.copy_(self.host_bytes)

    def _forward(self, key: tuple) -> torch.Tensor:
        b, steps = key[0], key[1]
        hidden = self.first_hidden[:b]
        positions, slots, context = self.positions[:steps, :b], self.slots[:steps, :b], self.context[:steps, :b]
        if len(key) == 2:
            ids, drawn = self.first_ids[:b], []
        else:  # run_from_state: the staged positions moved by each row's shift, draft 1 drawn here
            positions, slots, context = self._shifted(b, steps)
            ids = self.layer.compute_logits(hidden).argmax(dim=-1)
            drawn = [ids]
        for j in range(steps):
            meta = AttentionMetadata(slot_mapping=slots[j], block_tables=self.tables[:b],
                                     query_start_loc=self.query_start_loc[:b + 1], context_lens=context[j],
                                     max_query_len=1, max_context_len=self.width * self.block_size,
                                     block_size=self.block_size)
            hidden = self.layer(ids, positions[j], hidden, meta, self.kv_cache)
            ids = self.layer.compute_logits(hidden).argmax(dim=-1)
            drawn.append(ids)
        return torch.stack(drawn)

    def _shifted(self, b: int, steps: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The staged steps' positions + shift per row, and their slots and context lengths (staged
        padding steps, context 0, stay padding): [steps, b] each."""
        B = self.block_size
        live = self.context[:steps, :b] > 0
        pos = self.positions[:steps, :b] + self.shift[None, :b]
        block = self.tables[:b].gather(1, (pos // B).T.clamp(max=self.width - 1)).T.to(torch.int64)
        return (torch.where(live, pos, 0), torch.where(live, block * B + pos % B, -1),
                torch.where(live, pos + 1, 0).to(torch.int32))

    def _capture(self, key: tuple) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Warm-up and capture on padding inputs (every slot -1, context 0: nothing written or read)."""
        with use_kernel_config(self.kernel_config):
            self._stage(np.full((0, 1), -1, dtype=np.int32), np.zeros(0, np.int64), np.zeros(0, np.int64), key[1])
            self._copy()
            return capture_graph(lambda: self._forward(key), self.device, self.pool)
