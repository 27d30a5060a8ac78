"""The embedded SmolLM2-135M GGUF: pyengine vs transformers loading the same file."""
from __future__ import annotations

import os

import pytest
import torch

from pyengine.loader import load_model
from tests.utils_paged import greedy_generate

TEXTS = [
    "Hello, world!",
    "  leading spaces and   runs\tof\twhitespace\n\n\nnewlines ",
    "Digits 1234567890 and 3.14159, -42, 1e10",
    "unicode: café naïve 日本語 emoji 🤖🚀 Ünïcödé ß",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "code: def f(x):\n    return x**2  # comment\n",
    "<|endoftext|>mixed<repo_name>special",
    "",
]
PROMPTS = ["The capital of France is"]


@pytest.fixture(scope="module")
def hf_tokenizer(smollm2_path):
    transformers = pytest.importorskip("transformers")
    folder, name = os.path.split(smollm2_path)
    return transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)


@pytest.fixture(scope="module")
def hf_model(smollm2_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # transformers needs it to load GGUF
    folder, name = os.path.split(smollm2_path)
    return transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()


def _hf_greedy(model, ids: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """HF greedy tokens and the logits of the first generated token (no eos stop)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=steps, do_sample=False, eos_token_id=None,
                             pad_token_id=0, return_dict_in_generate=True, output_logits=True)
    return out.sequences[0, len(ids):].tolist(), out.logits[0][0].float()


def test_config_from_metadata(smollm2_fp32):
    _, config, tokenizer = smollm2_fp32
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads, config.num_key_value_heads) == (30, 576, 9, 3)
    assert config.tie_word_embeddings and config.rope_theta == 100000.0
    assert tokenizer.vocab_size == config.vocab_size == 49152
    assert tokenizer.eos_token_ids == [2]


def test_tokenizer_matches_hf(smollm2_fp32, hf_tokenizer):
    _, _, tokenizer = smollm2_fp32
    hf_tok = hf_tokenizer
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert ids == hf_tok.encode(text, add_special_tokens=True), text
        assert tokenizer.decode(ids, skip_special_tokens=False) == text
    assert tokenizer.encode("<|im_start|>") == [1]


def test_incremental_detokenizer_multibyte(smollm2_fp32):
    _, _, tokenizer = smollm2_fp32
    text = "naïve 日本語 🤖 emoji, then ascii."
    ids = tokenizer.encode(text)
    detok = tokenizer.incremental_detokenizer()
    pieces = [detok.add(i) for i in ids]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    assert len([p for p in pieces if p]) > 3  # it actually streams


def test_chat_template(smollm2_fp32, hf_tokenizer):
    _, _, tokenizer = smollm2_fp32
    messages = [{"role": "user", "content": "What is 2+2?"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert tokenizer.has_chat_template
    assert text.endswith("<|im_start|>assistant\n") and "<|im_start|>user\nWhat is 2+2?<|im_end|>" in text
    hf_text = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == hf_text


def test_greedy_matches_hf(smollm2_fp32, hf_model):
    model, config, tokenizer = smollm2_fp32
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Name a color."}])
    prompts = [tokenizer.encode(PROMPTS[0]), tokenizer.encode(chat)]
    ours, first_logits = greedy_generate(model, config, prompts, 16, block_size=16)
    for prompt, got, logits in zip(prompts, ours, first_logits):
        ref_tokens, ref_logits = _hf_greedy(hf_model, prompt, 16)
        assert got == ref_tokens
        torch.testing.assert_close(logits, ref_logits, atol=2e-3, rtol=1e-3)


def test_default_model_streams_its_quantised_weights_compactly(smollm2_fp32):
    """The default file is Q4_1 (+ a Q8_0 embedding): on an AVX-512 CPU every fp32 linear packs
    as 4-bit codes and the tied lm_head as 8-bit (csrc/cpu/cpu_gemm_affine.h), exact by construction;
    test_greedy_matches_hf runs on those weights."""
    from pyengine.ops.cpu import PackedLinear

    model = smollm2_fp32[0]
    if not isinstance(model.lm_logits_weight, PackedLinear):
        pytest.skip("this CPU runs oneDNN, not pyengine's packed GEMM")
    bits = {getattr(layer, name).bits_per_weight for layer in model.layers
            for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")}
    assert bits == {4}
    assert model.lm_logits_weight.bits_per_weight == 8


def test_missing_and_corrupt_files(tmp_path):
    with pytest.raises(ValueError, match="model file not found"):
        load_model(str(tmp_path / "missing.gguf"), "cpu", torch.float32)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(64))
    with pytest.raises(ValueError, match="GGUF") as info:
        load_model(str(bad), "cpu", torch.float32)
    assert "\n" not in str(info.value)
    text = tmp_path / "notes.gguf"
    text.write_text("hello, not a model")
    with pytest.raises(ValueError, match="GGUF"):
        load_model(str(text), "cpu", torch.float32)


# ---- pyengine's GGUF reader and dequantisation (pyengine/loader/gguf_reader.py, gguf_dequant.py) ----

QTYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"]


@pytest.fixture(scope="module")
def gguf_package_reader(smollm2_path):
    gguf = pytest.importorskip("gguf")
    return gguf.GGUFReader(smollm2_path, "r")


def test_reader_matches_gguf_package(smollm2_path, gguf_package_reader):
    """The same metadata (values and their Python types), tensor records and tensor bytes as
    gguf.GGUFReader, on the default file."""
    import numpy as np

    from pyengine.loader.gguf_reader import GGUFFile

    theirs = gguf_package_reader
    with GGUFFile(smollm2_path) as ours:
        expected = {key: field.contents() for key, field in theirs.fields.items()}
        assert ours.fields.keys() == expected.keys()
        for key, value in expected.items():
            assert ours.fields[key] == value and type(ours.fields[key]) is type(value), key
        assert len(ours.fields["tokenizer.ggml.tokens"]) == 49152 and len(ours.fields["tokenizer.ggml.merges"]) == 48900
        assert ours.data_offset == theirs.data_offset
        assert [(t.name, t.ggml_type, t.dims, t.offset, t.nbytes) for t in ours.tensors] == [
            (t.name, int(t.tensor_type), tuple(int(d) for d in t.shape), int(t.data_offset), int(t.n_bytes))
            for t in theirs.tensors]
        for mine, ref in zip(ours.tensors, theirs.tensors):
            assert np.array_equal(ours.data(mine), np.asarray(ref.data).reshape(-1).view(np.uint8)), mine.name


def test_loader_weights_are_gguf_dequantisation(smollm2_path, gguf_package_reader):
    """What the loader hands the model (Q8_0 embedding, Q4_1 linears with Q/K rows unpermuted,
    F32 norms) is gguf.quants' dequantisation of the same bytes, bit for bit, in [out, in] view."""
    import numpy as np
    from gguf.quants import dequantize

    from pyengine.loader.gguf_file import config_from_fields, iter_gguf_weights
    from pyengine.loader.gguf_reader import GGUFFile

    hf = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
          "blk.0.attn_q.weight": "model.layers.0.self_attn.q_proj.weight",
          "blk.0.attn_k.weight": "model.layers.0.self_attn.k_proj.weight",
          "blk.0.attn_v.weight": "model.layers.0.self_attn.v_proj.weight",
          "blk.0.ffn_down.weight": "model.layers.0.mlp.down_proj.weight",
          "blk.0.attn_norm.weight": "model.layers.0.input_layernorm.weight"}
    with GGUFFile(smollm2_path) as reader:
        config = config_from_fields(reader.fields, {t.name for t in reader.tensors})
        got = {name: w for name, w in iter_gguf_weights(reader, config, torch.float32) if name in hf.values()}
    assert len(got) == len(hf)
    for tensor in gguf_package_reader.tensors:
        if tensor.name not in hf:
            continue
        ref = torch.from_numpy(np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32))
        ref = ref.reshape(tuple(int(d) for d in reversed(tensor.shape)))
        heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}.get(tensor.name.split(".")[-2])
        if heads:  # llama.cpp's interleaved rotary pairs back to HF's halves
            ref = ref.reshape(heads, -1, 2, ref.shape[1]).transpose(1, 2).reshape(ref.shape)
        w = got[hf[tensor.name]]
        assert w.shape == ref.shape and torch.equal(w.contiguous().view(torch.int32), ref.view(torch.int32)), tensor.name


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("rows_at_once", [None, 20])
def test_dequantize_is_bit_identical_to_gguf_quants(qtype, rows_at_once, monkeypatch):
    """Random blocks (quantised values, and random bytes: any fp16 scale, inf and NaN included),
    in both orientations (transposed: in one go, or a few rows at a time) and with rows reordered
    first."""
    import numpy as np

    gguf = pytest.importorskip("gguf")
    from gguf.quants import dequantize as gguf_dequantize
    from gguf.quants import quantize

    from pyengine.loader import gguf_dequant
    from pyengine.loader.gguf_dequant import decode, dequantize

    if rows_at_once is not None:
        monkeypatch.setattr(gguf_dequant, "_ROWS_AT_ONCE", rows_at_once)

    kind = gguf.GGMLQuantizationType[qtype]
    rows, cols = 48, 256
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((rows, cols)) * rng.uniform(1e-3, 1e3, (rows, 1))).astype(np.float32)
    x[0, :32] = 0.0
    x[1, :32] = 1.5
    x[2, :32] = rng.uniform(0.5, 1.0, 32)  # one sign only: Q4_0's scale is negative
    quantised = quantize(x, kind).view(np.uint8).reshape(rows, -1)
    random_bytes = rng.integers(0, 256, quantised.shape, dtype=np.uint8)
    perm = rng.permutation(rows)
    for raw in (quantised, random_bytes):
        with np.errstate(all="ignore"):  # random scales: inf and NaN
            ref = gguf_dequantize(raw, kind).view(np.uint32)
        flat = raw.reshape(-1)
        assert np.array_equal(dequantize(flat, int(kind), (rows, cols)).view(np.uint32), ref)
        blocks = decode(flat, int(kind), rows, cols)
        assert np.array_equal(blocks.to_float(transposed=True).T.view(np.uint32), ref)
        reordered = blocks.map_rows(lambda a: a[perm]).to_float(transposed=True)
        assert reordered.flags.c_contiguous and np.array_equal(reordered.T.view(np.uint32), ref[perm])


def test_load_gguf_does_not_use_the_gguf_package(smollm2_path, monkeypatch):
    gguf = pytest.importorskip("gguf")
    import gguf.quants

    def refuse(*args, **kwargs):
        raise AssertionError("the gguf package was used")

    monkeypatch.setattr(gguf, "GGUFReader", refuse)
    monkeypatch.setattr(gguf.quants, "dequantize", refuse)
    _, config, tokenizer = load_model(smollm2_path, "cpu", torch.float32)
    assert config.num_hidden_layers == 30 and tokenizer.encode("<|im_start|>") == [1]


def test_default_model_keeps_no_dense_weights(smollm2_fp32):
    """Loaded packing as it goes: every linear packed, the tied lm_head's dense copy gone and its
    Q8_0 values kept as int8 codes for token embedding (bit for bit: test_greedy_matches_hf)."""
    from pyengine.ops.cpu import PackedLinear

    model = smollm2_fp32[0]
    if not isinstance(model.lm_logits_weight, PackedLinear):
        pytest.skip("this CPU runs oneDNN, not pyengine's packed GEMM")
    assert model.lm_head.numel() == 0 and model.embedding_columns is not None
    assert not any(p.dim() == 2 for p in model.parameters())


def test_int8_columns_exact_or_refused():
    from pyengine.models.llama import Int8Columns

    gen = torch.Generator().manual_seed(0)
    q = torch.randint(-127, 128, (64, 300), generator=gen).float()
    q[0] = 127  # every run has its largest code, as Q8_0 makes them
    q[32] = -127
    s = torch.rand(2, 1, 300, generator=gen).half().float() + 0.01
    w = (q.view(2, 32, 300) * s).view(64, 300)
    cols = Int8Columns.of(w, chunk=128)
    ids = torch.tensor([0, 299, 5, 5, 150])
    assert cols is not None and torch.equal(cols.gather(ids).view(torch.int32), w.t()[ids].contiguous().view(torch.int32))
    off = w.clone()
    off[3, 7] += 1e-4  # not a multiple of its run's scale
    assert Int8Columns.of(off) is None
    zeros = w.clone()
    zeros[5, :] = -0.0  # int8 has no -0: a dense table would keep its sign
    assert Int8Columns.of(zeros) is None


def _gguf_bytes(kvs: list[bytes], version: int = 3) -> bytes:
    import struct

    return b"GGUF" + struct.pack("<IQQ", version, 0, len(kvs)) + b"".join(kvs)


def _kv(key: str, vtype: int, payload: bytes) -> bytes:
    import struct

    return struct.pack("<Q", len(key)) + key.encode() + struct.pack("<I", vtype) + payload


def _string(raw: bytes) -> bytes:
    import struct

    return struct.pack("<Q", len(raw)) + raw


def test_reader_metadata_of_every_type(tmp_path):
    import struct

    from pyengine.loader.gguf_reader import GGUFFile

    strings = [b"", "caf\u00e9".encode(), "\u65e5\u672c".encode(), b"\xff\xfe", b"plain", "\U0001f916".encode()]
    kvs = [
        _kv("u8", 0, b"\xff"), _kv("i8", 1, b"\xff"), _kv("u16", 2, struct.pack("<H", 65535)),
        _kv("i16", 3, struct.pack("<h", -2)), _kv("u32", 4, struct.pack("<I", 7)), _kv("i32", 5, struct.pack("<i", -7)),
        _kv("f32", 6, struct.pack("<f", 0.1)), _kv("bool", 7, b"\x01"), _kv("str", 8, _string("na\u00efve".encode())),
        _kv("u64", 10, struct.pack("<Q", 2**64 - 1)), _kv("i64", 11, struct.pack("<q", -(2**63))),
        _kv("f64", 12, struct.pack("<d", 0.1)),
        _kv("strs", 9, struct.pack("<IQ", 8, len(strings)) + b"".join(_string(s) for s in strings)),
        _kv("split", 9, struct.pack("<IQ", 8, 2) + _string(b"a\xc3") + _string(b"\xa9b")),  # "é" cut in two
        _kv("ints", 9, struct.pack("<IQ", 5, 3) + struct.pack("<3i", 1, -2, 3)),
        _kv("empty", 9, struct.pack("<IQ", 8, 0)),
        _kv("nested", 9, struct.pack("<IQ", 9, 2) + struct.pack("<IQ", 0, 2) + b"\x01\x02"
            + struct.pack("<IQ", 8, 1) + _string(b"x")),
    ]
    path = tmp_path / "kinds.gguf"
    path.write_bytes(_gguf_bytes(kvs))
    with GGUFFile(str(path)) as f:
        fields = f.fields
    assert (fields["u8"], fields["i8"], fields["u16"], fields["i16"], fields["u32"], fields["i32"]) == (255, -1, 65535, -2, 7, -7)
    assert fields["f32"] == struct.unpack("<f", struct.pack("<f", 0.1))[0] and fields["f64"] == 0.1
    assert fields["bool"] is True and fields["str"] == "na\u00efve"
    assert (fields["u64"], fields["i64"]) == (2**64 - 1, -(2**63))
    assert fields["strs"] == [s.decode("utf-8", errors="replace") for s in strings]
    assert fields["split"] == ["a\ufffd", "\ufffdb"]
    assert fields["ints"] == [1, -2, 3] and fields["empty"] == [] and fields["nested"] == [[1, 2], ["x"]]
    assert (fields["GGUF.version"], fields["GGUF.tensor_count"], fields["GGUF.kv_count"]) == (3, 0, len(kvs))


READER_CASES = {
    "duplicate_key": (lambda: _gguf_bytes([_kv("a", 4, b"\0" * 4), _kv("a", 4, b"\0" * 4)]), r"metadata key 'a' appears twice"),
    "big_endian": (lambda: b"GGUF" + (3).to_bytes(4, "big") + bytes(16), r"big-endian GGUF files are not supported"),
    "unknown_value_type": (lambda: _gguf_bytes([_kv("a", 13, b"\0" * 8)]), r"metadata 'a': unknown value type 13"),
    "nested_too_deep": (lambda: _gguf_bytes([_kv("a", 9, (b"\x09\0\0\0" + (1).to_bytes(8, "little")) * 40)]),
                        r"metadata 'a': arrays nested more than 16 deep"),
    "string_past_end": (lambda: _gguf_bytes([_kv("a", 8, (2**40).to_bytes(8, "little"))]),
                        r"metadata 'a' string at byte \d+ runs past the end of the file"),
    "alignment_not_power_of_two": (lambda: _gguf_bytes([_kv("general.alignment", 4, (48).to_bytes(4, "little"))]),
                                   r"general.alignment 48 is not a power of two"),
}


@pytest.mark.parametrize("case", sorted(READER_CASES))
def test_reader_refuses_malformed_files(case, tmp_path):
    from pyengine.loader.gguf_reader import GGUFFile

    make, match = READER_CASES[case]
    path = tmp_path / "bad.gguf"
    path.write_bytes(make())
    with pytest.raises(ValueError, match=match) as info:
        GGUFFile(str(path))
    assert "\n" not in str(info.value)
