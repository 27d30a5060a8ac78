"""GGUF string arrays (a vocabulary and its merges): the C++ walk plus one decode and split give
each string exactly as decoding it alone would, on the fast path and on both fallbacks (a
newline inside a string, a string that is not UTF-8 on its own), and refuse a truncated array."""
from __future__ import annotations

import struct

import pytest

from pyengine.loader.gguf_reader import GGUFFile


def _string(raw: bytes) -> bytes:
    return struct.pack("<Q", len(raw)) + raw


def _file(tmp_path, arrays: dict[str, list[bytes]], tail: bytes = b"") -> str:
    """A GGUF v3 file of string arrays only; tail: bytes appended (a broken last array)."""
    kvs = [struct.pack("<Q", len(k)) + k.encode() + struct.pack("<IIQ", 9, 8, len(v)) + b"".join(map(_string, v))
           for k, v in arrays.items()]
    path = tmp_path / "strings.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, len(kvs) + (1 if tail else 0)) + b"".join(kvs) + tail)
    return str(path)


def _alone(strings: list[bytes]) -> list[str]:
    return [s.decode("utf-8", errors="replace") for s in strings]


# Lengths whose little-endian bytes hold 0x0A (10, 266, 2570): a length field must never be read as
# a separator. Multi-byte characters at every body boundary, and empty strings first, last and in
# the middle.
VALID = [b"", b"x" * 10, "é".encode() * 133, b"", "日本".encode(), b"a" * 2570, "🤖".encode(), "Ġthe".encode(), b""]
CASES = {
    "valid": VALID,
    "one": [b"only"],
    "one_empty": [b""],
    "newline_in_a_body": [b"a", b"b\nc", b"\n", b"d"],  # each alone; a split on newlines would be wrong
    "invalid_alone": [b"ok", b"\xff", b"fine"],
    "char_cut_between_bodies": [b"a\xc3", b"\xa9b"],  # valid joined, invalid alone
    "cut_last": ["é".encode() + b"\xe6\x97"],
}


FAST = {"valid", "one", "one_empty"}  # decoded without the per-string fallback


@pytest.mark.parametrize("case", sorted(CASES))
def test_string_arrays_decode_as_each_string_alone(case, tmp_path, monkeypatch):
    from pyengine.loader import gguf_reader

    strings = CASES[case]
    each = gguf_reader._decode_each
    calls: list[int] = []
    monkeypatch.setattr(gguf_reader, "_decode_each", lambda *a: calls.append(1) or each(*a))
    with GGUFFile(_file(tmp_path, {"a": strings, "b": VALID})) as f:
        assert len(calls) == (0 if case in FAST else 1)
        assert f.fields["a"] == _alone(strings)
        assert f.fields["b"] == _alone(VALID)  # the position after "a" is right


@pytest.mark.parametrize("tail", [
    struct.pack("<Q", 1) + b"t" + struct.pack("<IIQ", 9, 8, 3) + _string(b"ab") + _string(b"c"),  # a string missing
    struct.pack("<Q", 1) + b"t" + struct.pack("<IIQ", 9, 8, 2) + _string(b"ab") + struct.pack("<Q", 5) + b"abc",  # short body
    struct.pack("<Q", 1) + b"t" + struct.pack("<IIQ", 9, 8, 2) + _string(b"ab") + b"\x01\x02",  # short length
    struct.pack("<Q", 1) + b"t" + struct.pack("<IIQ", 9, 8, 1) + struct.pack("<Q", 2**64 - 1) + b"ab",  # huge length
])
def test_truncated_string_array_is_refused(tail, tmp_path):
    with pytest.raises(ValueError, match=r"metadata 't' (string array runs past the end|array of \d+ elements cannot fit)"):
        GGUFFile(_file(tmp_path, {"a": VALID}, tail))


def test_default_vocabulary_as_each_string_alone(smollm2_path):
    """The default model's tokens and merges (the fast path: valid UTF-8, no newline) equal a
    per-string walk over the same bytes."""
    with GGUFFile(smollm2_path) as f:
        fields = dict(f.fields)
        raw = memoryview(f._map)
        for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
            pos = bytes(raw).find(struct.pack("<Q", len(key)) + key.encode()) + 8 + len(key) + 4
            etype, count = struct.unpack_from("<IQ", raw, pos)
            pos += 12
            strings = []
            for _ in range(count):
                (n,) = struct.unpack_from("<Q", raw, pos)
                strings.append(bytes(raw[pos + 8:pos + 8 + n]))
                pos += 8 + n
            assert etype == 8 and fields[key] == _alone(strings) and len(strings) > 40000
        raw.release()
