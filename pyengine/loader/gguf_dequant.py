"""GGUF tensor bytes -> float32, vectorised over the whole tensor, bit for bit gguf.quants'.

F32, F16, BF16, Q8_0, Q4_0 and Q4_1 are decoded here; other types go through gguf.quants. A
block-quantised tensor is first taken apart into its codes and per-block scale (and offset), so
that rows can be reordered and the matrix transposed on the codes (a byte or half a byte a
weight), and the float32 weights are made once, in their final layout, by the float32 operations
of gguf.quants (d * q, or (d * q) + m: two roundings, never a fused multiply-add).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

F32, F16, Q4_0, Q4_1, Q8_0, BF16 = 0, 1, 2, 3, 8, 30
BLOCK = 32  # values per block of Q4_0 / Q4_1 / Q8_0
_ROWS_AT_ONCE = 4096  # rows transposed together: a layer's matrices in one go
BLOCK_LAYOUTS = {  # the fp16 scale d (and offset m), then the codes
    Q4_0: np.dtype([("d", "<f2"), ("qs", "u1", (16,))]),
    Q4_1: np.dtype([("d", "<f2"), ("m", "<f2"), ("qs", "u1", (16,))]),
    Q8_0: np.dtype([("d", "<f2"), ("qs", "i1", (32,))]),
}


@dataclass
class Blocks:
    """A [rows, cols] tensor as its codes and per-block scale (and offset), every part indexed
    by row first, so that rows can be reordered before anything is widened to float32.

    kind "float": `codes` are the values [rows, cols] (float32, or float16: widened exactly);
    "q8": codes int8 [rows, nb, 32], w = q * scale (Q8_0);
    "q4": codes uint8 [rows, nb, 16], byte j holding value j (low nibble) and value j + 16 (high
    nibble) of its block; w = (scale * q) + offset (Q4_1), or scale * (q - 8) (Q4_0: offset None)."""

    kind: str
    codes: np.ndarray
    scale: np.ndarray | None = None  # [rows, nb] float32
    offset: np.ndarray | None = None  # [rows, nb] float32

    def map_rows(self, f: Callable[[np.ndarray], np.ndarray]) -> Blocks:
        """The same tensor with f (a reordering along axis 0) applied to every part."""
        return Blocks(self.kind, f(self.codes), None if self.scale is None else f(self.scale),
                      None if self.offset is None else f(self.offset))

    def to_float(self, transposed: bool = False) -> np.ndarray:
        """float32 [rows, cols], or its transpose [cols, rows]: always a new C-contiguous array,
        never a view of the file. Transposed, rows go a chunk at a time, so that the transposed
        codes in flight stay small next to the result (a vocabulary's embedding)."""
        if self.kind == "float":
            return np.array(self.codes.T if transposed else self.codes, dtype=np.float32, order="C")
        rows, nb = self.codes.shape[:2]
        if not transposed:  # [rows, nb, 32]
            w = np.empty((rows, nb, BLOCK), dtype=np.float32)
            self._fill(w, 2, self.codes, self.scale[:, :, None], None if self.offset is None else self.offset[:, :, None])
            return w.reshape(rows, nb * BLOCK)
        w = np.empty((nb, BLOCK, rows), dtype=np.float32)  # row b * 32 + i: input i of block b
        for r0 in range(0, rows, _ROWS_AT_ONCE):
            part = slice(r0, r0 + _ROWS_AT_ONCE)
            offset = None if self.offset is None else np.ascontiguousarray(self.offset[part].T)[:, None, :]
            self._fill(w[:, :, part], 1, np.ascontiguousarray(self.codes[part].transpose(1, 2, 0)),
                       np.ascontiguousarray(self.scale[part].T)[:, None, :], offset)
        return w.reshape(nb * BLOCK, rows)

    def _fill(self, w: np.ndarray, axis: int, codes: np.ndarray, scale: np.ndarray, offset: np.ndarray | None) -> None:
        """w = scale * codes (+ offset) by gguf.quants' float32 operations; w and codes are 3-D
        with a block's 32 values (q8) or 16 bytes (q4) along `axis`."""
        if self.kind == "q8":
            np.copyto(w, codes)  # int8 -> float32: exact
        else:
            lo = [slice(None)] * 3
            hi = [slice(None)] * 3
            lo[axis], hi[axis] = slice(0, 16), slice(16, 32)
            np.bitwise_and(codes, 0x0F, out=w[tuple(lo)])
            np.right_shift(codes, 4, out=w[tuple(hi)])
            if offset is None:
                w -= 8  # exact: the float32 of gguf.quants' int8 (q - 8)
        with np.errstate(all="ignore"):  # a file's inf / NaN scales give inf / NaN weights, as in gguf.quants
            w *= scale
            if offset is not None:
                w += offset


def decode(raw: np.ndarray, ggml_type: int, rows: int, cols: int) -> Blocks:
    """The bytes of a [rows, cols] GGUF tensor (cols: the row length) as Blocks, whose codes are
    views of raw where the type allows."""
    if ggml_type == F32:
        return Blocks("float", raw.view(np.float32).reshape(rows, cols))
    if ggml_type == F16:
        return Blocks("float", raw.view(np.float16).reshape(rows, cols))
    if ggml_type == BF16:
        return Blocks("float", (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(rows, cols))
    if ggml_type in BLOCK_LAYOUTS:
        blocks = raw.view(BLOCK_LAYOUTS[ggml_type]).reshape(rows, cols // BLOCK)
        d = blocks["d"].astype(np.float32)
        if ggml_type == Q8_0:
            return Blocks("q8", blocks["qs"], d)
        return Blocks("q4", blocks["qs"], d, blocks["m"].astype(np.float32) if ggml_type == Q4_1 else None)
    try:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize as gguf_dequantize

        values = gguf_dequantize(raw.reshape(rows, -1), GGMLQuantizationType(ggml_type))
    except (ImportError, NotImplementedError) as exc:
        raise ValueError(f"cannot dequantise ggml type {ggml_type}: {str(exc).splitlines()[0]}") from None
    return Blocks("float", values.reshape(rows, cols))


def dequantize(raw: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> np.ndarray:
    """GGUF tensor bytes -> a new float32 array of `shape` (numpy order: the row length last)."""
    cols = shape[-1] if shape else 1
    rows = int(np.prod(shape[:-1], dtype=np.int64)) if len(shape) > 1 else 1
    return decode(raw, ggml_type, rows, cols).to_float().reshape(shape)
