"""pyengine's GGUF reader (llama.cpp's format, v2/v3, little-endian) over a memory map of the file.

Metadata comes back as plain Python values (numbers, strings, lists; nested arrays as nested
lists), with string arrays (a vocabulary and its merges: ~100k strings) located by one C++ walk
(csrc/cpu/gguf_strings.h) and decoded as one text, not one Python step per string; tensors as (name, type, dims, offset)
records whose data are numpy views of the map. Every read is checked against the end of the
file, and every malformed file is a one-line ValueError naming what is wrong.
"""
from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any, NoReturn

import numpy as np

from pyengine.ops.cpu.extension import kernels

# Metadata value types.
_STRING, _ARRAY = 8, 9
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
                   12: "<d"}
_SCALAR_DTYPES = {k: np.dtype(v.replace("?", "b1")) for k, v in _SCALAR_FORMATS.items()}
_INT_TYPES = (0, 1, 2, 3, 4, 5, 10, 11)
_MAX_DIMS = 4  # GGML_MAX_DIMS
_MAX_NESTING = 16  # arrays of arrays: far more than any model uses, far less than Python's stack
_DEFAULT_ALIGNMENT = 32

# ggml tensor type -> (values per block, bytes per block): ggml's public type table.
GGML_BLOCKS: dict[int, tuple[int, int]] = {
    0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34), 9: (32, 40),
    10: (256, 84), 11: (256, 110), 12: (256, 144), 13: (256, 176), 14: (256, 210), 15: (256, 292),
    16: (256, 66), 17: (256, 74), 18: (256, 98), 19: (256, 50), 20: (32, 18), 21: (256, 110), 22: (256, 82),
    23: (256, 136), 24: (1, 1), 25: (1, 2), 26: (1, 4), 27: (1, 8), 28: (1, 8), 29: (256, 56), 30: (1, 2),
    34: (256, 54), 35: (256, 66), 39: (32, 17), 40: (64, 36), 41: (128, 18),
}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    ggml_type: int
    dims: tuple[int, ...]  # GGUF order: the row length first
    offset: int  # absolute byte offset of the data in the file
    nbytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """numpy / torch order: the row length last."""
        return tuple(reversed(self.dims))


class GGUFFile:
    """An open GGUF file: `fields` (key -> value, plus GGUF.version / tensor_count / kv_count),
    `tensors` in file order, `data(tensor)` a read-only uint8 view of a tensor's bytes. Close it
    (or use it as a context manager) once no view is in use."""

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            with open(path, "rb") as f:
                self.size = os.fstat(f.fileno()).st_size
                if self.size < 24:
                    raise ValueError(f"not a valid GGUF file: {path} (only {self.size} bytes)")
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as e:
            raise ValueError(f"cannot read {path}: {e.strerror or e}") from None
        self.pos = 0
        try:
            self._parse()
        except BaseException:
            self.close()
            raise
        self.release(0, self.data_offset)  # the header is parsed: its pages need not stay resident

    # ---- bounds-checked reads ----
    def fail(self, what: str) -> NoReturn:
        raise ValueError(f"not a valid GGUF file: {self.path} ({what})")

    def _need(self, n: int, what: str) -> int:
        """Claim n bytes at pos; returns their start."""
        if n < 0 or self.pos + n > self.size:
            self.fail(f"{what} at byte {self.pos} runs past the end of the file ({self.size} bytes): truncated or corrupt")
        start = self.pos
        self.pos += n
        return start

    def _scalar(self, vtype: int, what: str) -> Any:
        fmt = _SCALAR_FORMATS[vtype]
        return struct.unpack_from(fmt, self._map, self._need(struct.calcsize(fmt), what))[0]

    def _u32(self, what: str) -> int:
        return int(self._scalar(4, what))

    def _u64(self, what: str) -> int:
        return int(self._scalar(10, what))

    def _string(self, what: str) -> str:
        n = self._u64(f"{what} length")
        start = self._need(n, what)
        return self._map[start:start + n].decode("utf-8", errors="replace")

    def _value(self, vtype: int, key: str, depth: int = 0) -> Any:
        if vtype in _SCALAR_FORMATS:
            return self._scalar(vtype, f"metadata {key!r} value")
        if vtype == _STRING:
            return self._string(f"metadata {key!r} string")
        if vtype != _ARRAY:
            self.fail(f"metadata {key!r}: unknown value type {vtype}")
        etype = self._u32(f"metadata {key!r} array type")
        count = self._u64(f"metadata {key!r} array length")
        if etype in _SCALAR_DTYPES:
            dtype = _SCALAR_DTYPES[etype]
            start = self._need(count * dtype.itemsize, f"metadata {key!r} array of {count}")
            return np.frombuffer(self._map, dtype, count, start).tolist()
        if count > self.size - self.pos:  # every element takes at least one byte
            self.fail(f"metadata {key!r}: array of {count} elements cannot fit in the file")
        if etype == _STRING:
            return self._string_array(count, key)
        if etype == _ARRAY:
            if depth >= _MAX_NESTING:
                self.fail(f"metadata {key!r}: arrays nested more than {_MAX_NESTING} deep")
            return [self._value(_ARRAY, key, depth + 1) for _ in range(count)]
        self.fail(f"metadata {key!r}: unknown array element type {etype}")

    def _string_array(self, count: int, key: str) -> list[str]:
        """count (u64 length, bytes) strings: the C++ walk finds where each body lies, then all the
        bodies are decoded as one UTF-8 text and split (_decode_bodies)."""
        starts = np.empty(count, dtype=np.int64)
        whole = np.frombuffer(self._map, np.uint8)  # for its address only; dropped at once (close needs no view)
        end = kernels.gguf_string_starts(whole.ctypes.data, self.size, self.pos, count, starts.ctypes.data)
        del whole
        if end < 0:
            self.fail(f"metadata {key!r} string array runs past the end of the file ({self.size} bytes): truncated or corrupt")
        self.pos = end
        return _decode_bodies(self._map, starts, end)

    # ---- structure ----
    def _parse(self) -> None:
        if self._map[0:4] != b"GGUF":
            self.fail("no GGUF magic number")
        self.pos = 4
        version = self._u32("version")
        if version not in (2, 3):
            if version & 0xFFFF == 0 and version >> 24 in (2, 3):
                self.fail("big-endian GGUF files are not supported")
            self.fail(f"unsupported GGUF version {version}")
        n_tensors, n_kv = self._u64("tensor count"), self._u64("metadata count")
        if n_tensors > self.size or n_kv > self.size:
            self.fail(f"the header claims {n_tensors} tensors and {n_kv} metadata entries, more than a "
                      f"{self.size}-byte file can hold (truncated?)")
        self.version = version
        fields: dict[str, Any] = {"GGUF.version": version, "GGUF.tensor_count": n_tensors, "GGUF.kv_count": n_kv}
        alignment = _DEFAULT_ALIGNMENT
        for i in range(n_kv):
            key = self._string(f"metadata key {i}")
            if key in fields:
                self.fail(f"metadata key {key!r} appears twice")
            vtype = self._u32(f"metadata {key!r} type")
            fields[key] = self._value(vtype, key)
            if key == "general.alignment":
                if vtype not in _INT_TYPES:
                    self.fail(f"general.alignment must be an integer, got value type {vtype}")
                alignment = fields[key]
        if alignment <= 0 or alignment & (alignment - 1):
            self.fail(f"general.alignment {alignment} is not a power of two")
        infos = [self._tensor_info(i) for i in range(n_tensors)]
        self.alignment = alignment
        self.data_offset = -(-self.pos // alignment) * alignment
        self.fields = fields
        self.tensors: list[GGUFTensor] = []
        names: set[str] = set()
        for name, qtype, dims, offset, nbytes in infos:
            start = self.data_offset + offset
            if start + nbytes > self.size:
                self.fail(f"tensor {name!r} data offset past end of file: bytes {start}..{start + nbytes} "
                          f"of a {self.size}-byte file (truncated?)")
            if name in names:
                self.fail(f"tensor {name!r} appears twice")
            names.add(name)
            self.tensors.append(GGUFTensor(name, qtype, dims, start, nbytes))

    def _tensor_info(self, i: int) -> tuple[str, int, tuple[int, ...], int, int]:
        name = self._string(f"tensor {i} name")
        n_dims = self._u32(f"tensor {name!r} rank")
        if not 1 <= n_dims <= _MAX_DIMS:
            self.fail(f"tensor {name!r} has rank {n_dims} (1..{_MAX_DIMS})")
        dims = tuple(self._u64(f"tensor {name!r} shape") for _ in range(n_dims))
        qtype = self._u32(f"tensor {name!r} type")
        offset = self._u64(f"tensor {name!r} data offset")
        if qtype not in GGML_BLOCKS:
            self.fail(f"tensor {name!r} has unknown data type {qtype}")
        block, type_size = GGML_BLOCKS[qtype]
        if dims[0] % block:
            self.fail(f"tensor {name!r}: row length {dims[0]} is not a multiple of its type's block size {block}")
        n = 1
        for d in dims:
            n *= d
        return name, qtype, dims, offset, n // block * type_size

    # ---- data ----
    def data(self, tensor: GGUFTensor) -> np.ndarray:
        """The tensor's bytes: a read-only uint8 view of the map (valid until close)."""
        return np.frombuffer(self._map, np.uint8, tensor.nbytes, tensor.offset)

    def release(self, start: int, end: int) -> None:
        """Drop the mapped pages of bytes [start, end) from this process's resident memory (they
        stay in the page cache; a later read maps them again)."""
        page = mmap.PAGESIZE
        lo, hi = start // page * page, min(-(-end // page) * page, -(-self.size // page) * page)
        if hi > lo and hasattr(self._map, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
            self._map.madvise(mmap.MADV_DONTNEED, lo, hi - lo)

    def close(self) -> None:
        try:
            self._map.close()
        except BufferError:  # a view of the data is still alive; the map goes with the last one
            pass

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _decode_bodies(buf: mmap.mmap, starts: np.ndarray, end: int) -> list[str]:
    """The strings whose bodies start at `starts` (each ends at the next one's 8-byte length field,
    the last at `end`), decoded as UTF-8; an invalid string decodes with U+FFFD replacements.

    The bytes from the first body to `end` become one text with each length field cut to a single
    newline: one decode and one split make every string (no Python loop). A newline only ever
    encodes itself in UTF-8, so where no body holds one the pieces are exactly the bodies, and the
    text decodes exactly when every body does on its own (a character cut between two bodies now
    has a newline inside it). Otherwise each body is decoded alone."""
    count = len(starts)
    if count == 0:
        return []
    first = int(starts[0])
    region = np.frombuffer(buf, np.uint8, end - first, first)
    fields = starts[1:] - first - 8  # the later strings' length fields, as offsets in region
    keep = np.ones(len(region), dtype=bool)
    keep[(fields[:, None] + np.arange(7)).ravel()] = False  # all of each field but its last byte
    joined = region[keep]  # a copy
    newlines = fields - 7 * np.arange(count - 1)  # each field's last byte in joined (7 dropped per field up to it)
    if not (joined == 0x0A).any():  # no newline in a body (a field's last byte is 0: lengths < 2**56)
        joined[newlines] = 0x0A
        try:
            return joined.tobytes().decode("utf-8").split("\n")
        except UnicodeDecodeError:
            pass
    return _decode_each(buf, starts, end)


def _decode_each(buf: mmap.mmap, starts: np.ndarray, end: int) -> list[str]:
    """_decode_bodies one string at a time (the slow way)."""
    ends = np.append(starts[1:] - 8, end)
    return [bytes(buf[a:b]).decode("utf-8", errors="replace") for a, b in zip(starts.tolist(), ends.tolist())]
