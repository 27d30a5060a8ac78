"""Packing GGUF Q4_0 / Q4_1 / Q8_0 weights straight from their blocks (loader/gguf_codes.py) holds the
file's very weights: where the CPU runs the integer-dot GEMMs (csrc/cpu/cpu_gemm_qdot.h: two int16
limbs under KernelConfig.cpu_int16_dot, int8 under cpu_int8_dot) every linear computes its
pure-PyTorch spec (pyengine/ops/reference/quant_dot.py) on the file's codes bit for bit, else
(csrc/cpu/cpu_gguf_pack.h, and by default) the products of the dequantised weights, as packing
those does."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from pyengine.loader.gguf_dequant import Q4_0, Q4_1, Q8_0, decode, dequantize
from pyengine.ops.kernel_config import KernelConfig, use_kernel_config
from pyengine.ops.reference.quant_dot import gguf_weight_codes, quant_linear

cpu_ops = pytest.importorskip("pyengine.ops.cpu")
PackedLinear = cpu_ops.PackedLinear

LAYOUTS = {Q4_0: [("d", "<f2"), ("qs", "u1", (16,))], Q4_1: [("d", "<f2"), ("m", "<f2"), ("qs", "u1", (16,))],
           Q8_0: [("d", "<f2"), ("qs", "i1", (32,))]}


def random_blocks(ggml_type: int, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """A [rows, cols] tensor's raw bytes, scales spanning normal, subnormal, negative and zero fp16."""
    rng = np.random.default_rng(seed)
    blocks = np.zeros((rows, cols // 32), dtype=np.dtype(LAYOUTS[ggml_type]))
    d = rng.standard_normal(blocks.shape) * 10.0 ** rng.integers(-7, 2, blocks.shape)
    d.flat[:4] = [0.0, -0.0, 6e-8, -3e-6]  # zero, negative zero, subnormals
    blocks["d"] = d.astype(np.float16)
    if ggml_type == Q4_1:
        blocks["m"] = (rng.standard_normal(blocks.shape) * 0.1).astype(np.float16)
    blocks["qs"] = rng.integers(-128 if ggml_type == Q8_0 else 0, 128 if ggml_type == Q8_0 else 256,
                                blocks["qs"].shape)
    return blocks.view(np.uint8).reshape(rows, -1)


def addresses(raw: np.ndarray, order: np.ndarray) -> np.ndarray:
    return (np.uint64(raw.ctypes.data) + order.astype(np.uint64) * np.uint64(raw.shape[1])).astype(np.uint64)


@pytest.mark.parametrize("ggml_type", [Q4_0, Q4_1, Q8_0])
def test_from_gguf_computes_the_files_weights(ggml_type):
    rows, cols = 40, 96  # 40 outputs: a partial last panel
    raw = random_blocks(ggml_type, rows, cols)
    order = np.random.default_rng(1).permutation(rows)  # rows taken in another order (rope, fused)
    dense = torch.from_numpy(dequantize(raw.reshape(-1), ggml_type, (rows, cols))[order].T.copy())  # [in, out]
    reference = PackedLinear(dense)
    if reference.isa != "avx2" and reference.isa != "avx512":
        pytest.skip("no packed GEMM here")
    packed = PackedLinear.from_gguf(ggml_type, addresses(raw, order), cols)
    assert packed is not None and packed.bits_per_weight == (8 if ggml_type == Q8_0 else 4)
    assert (packed.in_features, packed.out_features) == (cols, rows)
    assert torch.equal(packed.columns(torch.arange(rows)), dense.t())  # the weights themselves (as numbers)
    x = torch.randn(7, cols)
    if packed.int8_dot or packed.int16_dot:
        blocks = decode(raw.reshape(-1), ggml_type, rows, cols).map_rows(lambda a: a[order])
        act_bits = 8 if packed.int8_dot else 32
        assert torch.equal(packed(x), quant_linear(x, *gguf_weight_codes(blocks), act_bits=act_bits))
    else:
        assert torch.equal(packed(x), reference(x))
    exact = PackedLinear.from_gguf(ggml_type, addresses(raw, order), cols, int8_dot=False, int16_dot=False)
    assert not exact.int8_dot and not exact.int16_dot and torch.equal(exact(x), reference(x))
    limbs = PackedLinear.from_gguf(ggml_type, addresses(raw, order), cols, int8_dot=False, int16_dot=True)
    if limbs.int16_dot:  # where the CPU has AVX2 + F16C
        blocks = decode(raw.reshape(-1), ggml_type, rows, cols).map_rows(lambda a: a[order])
        assert torch.equal(limbs(x), quant_linear(x, *gguf_weight_codes(blocks), act_bits=32))


def test_from_gguf_refuses_what_it_cannot_pack():
    raw = random_blocks(Q4_1, 16, 64)
    raw.view(np.dtype(LAYOUTS[Q4_1]))["m"][3, 1] = np.inf
    assert PackedLinear.from_gguf(Q4_1, addresses(raw, np.arange(16)), 64) is None
    raw8 = random_blocks(Q8_0, 16, 64)
    raw8.view(np.dtype(LAYOUTS[Q8_0]))["d"][0, 0] = np.nan
    assert PackedLinear.from_gguf(Q8_0, addresses(raw8, np.arange(16)), 64) is None
    assert PackedLinear.from_gguf(12, addresses(raw8, np.arange(16)), 64) is None  # Q4_K: not from codes
    with pytest.raises(ValueError):
        PackedLinear.from_gguf(Q8_0, np.arange(16, dtype=np.int64), 64)


def _load(path: str, from_codes: bool):
    from pyengine.loader.gguf_file import load_gguf

    model, config, tokenizer = load_gguf(path, torch.float32, prepack_cpu=True, from_codes=from_codes)
    model.prepack_for_cpu()
    return model, config, tokenizer


ROW_BYTES = {Q4_0: 18, Q4_1: 20, Q8_0: 34}  # per 32 inputs


def _recording_from_gguf(monkeypatch, refuse=()) -> list:
    """PackedLinear.from_gguf, recording per call (the PackedLinear, its matrix as the reference's
    (scale, offset, codes)); calls numbered in `refuse` return None (the caller dequantises)."""
    calls: list = []
    from_gguf = PackedLinear.from_gguf.__func__

    def record(cls, ggml_type, rows, in_features):
        calls.append((None, ()))
        if len(calls) in refuse:
            return None
        nbytes = in_features // 32 * ROW_BYTES[ggml_type]
        raw = np.stack([np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(int(a))) for a in rows])
        packed = from_gguf(cls, ggml_type, rows, in_features)
        calls[-1] = (packed, gguf_weight_codes(decode(raw.reshape(-1), ggml_type, len(rows), in_features)))
        return packed

    monkeypatch.setattr(PackedLinear, "from_gguf", classmethod(record))
    return calls


def _linears(model) -> list:
    return [getattr(layer, name) for layer in model.layers
            for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")] + [model.packed_lm_head]


def _close_logits(a, b, tight: bool = False) -> None:
    """The int8 dots move a model's logits about as llama.cpp's do (benchmarks/quality_cpu_qdot.py:
    mean 0.17 over 3078 positions); two prompts' greedy first tokens, with clear margins, agree.
    tight (two int16 limbs): within test_gguf.py's tolerance of HF's logits instead."""
    from tests.utils_paged import greedy_generate

    prompts = [a[2].encode("The capital of France is"), a[2].encode("def fib(n):")]
    tokens_a, logits_a = greedy_generate(a[0], a[1], prompts, 1)
    tokens_b, logits_b = greedy_generate(b[0], b[1], prompts, 1)
    assert tokens_a == tokens_b
    for x, y in zip(logits_a, logits_b):
        if tight:
            torch.testing.assert_close(x, y, atol=2e-3, rtol=1e-3)
        assert (x - y).abs().mean() < 1.0 and (x - y).abs().max() < 5.0


@pytest.fixture(scope="module")
def dequantised_model(smollm2_path):
    model = _load(smollm2_path, from_codes=False)
    if not isinstance(model[0].lm_logits_weight, PackedLinear):
        pytest.skip("this CPU runs oneDNN, not pyengine's packed GEMM")
    return model


@pytest.mark.parametrize("arith", ["default", "int16", "exact", "int8"])
def test_default_model_packed_from_codes_computes_the_reference(smollm2_path, dequantised_model, monkeypatch,
                                                                arith):
    """Every linear and the lm_head, packed from the file's blocks through the model's own mapping
    (q/k rows reordered, fused projections), computes bit for bit what the dequantised model's
    linear computes (by default, and with both integer dots off), or the two-int16-limb reference
    on those blocks (KernelConfig.cpu_int16_dot), or the int8-dot reference (cpu_int8_dot); the
    token embeddings are the dequantised model's."""
    calls = _recording_from_gguf(monkeypatch)
    if arith == "default":
        config = KernelConfig()
        arith = "int8" if config.cpu_int8_dot else "int16" if config.cpu_int16_dot else "exact"
    else:
        config = KernelConfig(cpu_int8_dot=arith == "int8", cpu_int16_dot=arith == "int16")
    with use_kernel_config(config):
        model = _load(smollm2_path, from_codes=True)
    assert model[0].lm_head.numel() == 0 and model[0].cpu_stack is not None
    codes = {id(p): c for p, c in calls}
    linears = _linears(model[0])
    assert all(id(w) in codes for w in linears)
    ids = torch.arange(model[1].vocab_size)
    assert torch.equal(model[0].embedding_columns.gather(ids), dequantised_model[0].embedding_columns.gather(ids))
    if arith != "exact" and not (linears[0].int8_dot or linears[0].int16_dot):
        pytest.skip("this CPU packs the codes for the dequantised weights' products (no AVX2 + F16C)")
    gen = torch.Generator().manual_seed(0)
    for w, dense in zip(linears, _linears(dequantised_model[0])):
        x = torch.randn(3, w.in_features, generator=gen)
        if arith == "int8":
            assert w.int8_dot and torch.equal(w(x), quant_linear(x, *codes[id(w)]))
        elif arith == "int16":
            assert w.int16_dot and torch.equal(w(x), quant_linear(x, *codes[id(w)], act_bits=32))
        else:
            assert not w.int8_dot and not w.int16_dot and torch.equal(w(x), dense(x))
    _close_logits(model, dequantised_model, tight=arith != "int8")


def test_a_linear_the_codes_cannot_pack_is_dequantised(smollm2_path, dequantised_model, monkeypatch):
    """A refusal (here of the lm_head and of one decoder linear) sends just that weight down the
    dequantising path: it computes what the dequantised model's does, bit for bit."""
    calls = _recording_from_gguf(monkeypatch, refuse=(1, 10))  # the tied embedding (first in the file), a layer's
    model = _load(smollm2_path, from_codes=True)
    assert calls[0][0] is None and len(calls) == 1 + 4 * model[1].num_hidden_layers
    refused = [i for i, w in enumerate(_linears(model[0])) if all(w is not p for p, _ in calls)]
    assert len(refused) == 2 and refused[-1] == 4 * model[1].num_hidden_layers  # the lm_head among them
    gen = torch.Generator().manual_seed(1)
    for i, (a, b) in enumerate(zip(_linears(model[0]), _linears(dequantised_model[0]))):
        x = torch.randn(3, a.in_features, generator=gen)
        if i in refused:
            assert not a.int8_dot and not a.int16_dot and torch.equal(a(x), b(x))
    ids = torch.arange(model[1].vocab_size)
    assert torch.equal(model[0].embedding_columns.gather(ids), dequantised_model[0].embedding_columns.gather(ids))
    _close_logits(model, dequantised_model)


@pytest.mark.parametrize("ggml_type", [Q4_0, Q4_1, Q8_0])
def test_packed_columns_are_the_dequantised_rows(ggml_type):
    """A tied embedding's rows read back from the packed codes (PackedLinear.columns): Q8_0 bit for
    bit, -0 included (d * q, as GGUF dequantises); 4-bit equal as numbers (fma(s, q, m))."""
    rows, cols = 40, 96
    raw = random_blocks(ggml_type, rows, cols, seed=3)
    packed = PackedLinear.from_gguf(ggml_type, addresses(raw, np.arange(rows)), cols)
    if packed is None or packed.isa not in ("avx2", "avx512", "amx"):
        pytest.skip("no packed GEMM here")
    table = torch.from_numpy(dequantize(raw.reshape(-1), ggml_type, (rows, cols)).copy())  # [rows, cols]
    ids = torch.tensor([0, 39, 17, 17, 16, 15, 1])
    got = packed.columns(ids)
    assert got.shape == (len(ids), cols)
    if ggml_type == Q8_0:
        assert torch.equal(got.view(torch.int32), table[ids].view(torch.int32))
    else:
        assert torch.equal(got, table[ids])
        if not packed.int8_dot and not packed.int16_dot:  # the GEMM's own weights (integer dots quantise the eye's rows too)
            assert torch.equal(got, packed(torch.eye(cols)).t()[ids])
    with pytest.raises(IndexError):
        packed.columns(torch.tensor([rows]))


def test_packed_columns_of_float_weights_exact_or_refused():
    """From float32 weights (not a GGUF file) the packed codes stand for the embedding only where
    every bit comes back; a -0 weight (no code holds its sign) keeps the dense table."""
    from pyengine.models.llama import PackedColumns

    gen = torch.Generator().manual_seed(5)
    q = torch.randint(-127, 128, (2, 32, 48), generator=gen).float()
    q[:, 0] = 127  # every run holds its largest code, as Q8_0 makes them
    s = torch.rand(2, 1, 48, generator=gen).half().float() + 0.01
    w = (q * s).view(64, 48)  # [hidden 64, vocab 48]
    packed = PackedLinear(w)
    if packed.bits_per_weight != 8:
        pytest.skip("no packed GEMM here")
    columns = PackedColumns.of(packed, w, chunk=20)
    ids = torch.arange(48)
    assert columns is not None and torch.equal(columns.gather(ids).view(torch.int32), w.t().contiguous().view(torch.int32))
    signed = w.clone()
    signed[:, 7] = -0.0  # packs (as +0: equal as numbers), reads back +0
    assert PackedColumns.of(PackedLinear(signed), signed) is None


def test_default_model_keeps_the_tied_codes_once(smollm2_path):
    """The default model's token embeddings read the packed lm_head's codes (no second copy of
    them), and give the file's dequantised token_embd rows bit for bit."""
    from pyengine.loader.gguf_reader import GGUFFile
    from pyengine.models.llama import PackedColumns

    model, config, _ = _load(smollm2_path, from_codes=True)
    if not isinstance(model.lm_logits_weight, PackedLinear):
        pytest.skip("this CPU runs oneDNN, not pyengine's packed GEMM")
    assert isinstance(model.embedding_columns, PackedColumns) and model.embedding_columns.packed is model.packed_lm_head
    reader = GGUFFile(smollm2_path)
    tensor = next(t for t in reader.tensors if t.name == "token_embd.weight")
    table = dequantize(reader.data(tensor), tensor.ggml_type, (config.vocab_size, config.hidden_size))
    ids = torch.tensor([0, 1, 2, 100, 4096, config.vocab_size - 1])
    want = torch.from_numpy(np.ascontiguousarray(table[ids.numpy()]))
    assert torch.equal(model.embed(ids).view(torch.int32), want.view(torch.int32))
