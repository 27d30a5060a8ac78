"""Issue 23, "Bad input, everywhere", for model files: broken HF checkpoints (tiny random Llamas
written here, then mutated) and broken GGUF files (truncated / corrupted copies of the default
GGUF's header, and tiny GGUFs written here) each give one ValueError line naming the file or tensor
and the problem, never a traceback.
"""
from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pyengine import LLM, SamplingParams
from tests.bad_input_checkpoints import CONFIG, with_config, with_file, write_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("bad_input") / "tiny"
    write_checkpoint(path)
    return path


# ---- broken HF checkpoints ---------------------------------------------------------------------------


def _tensors(change: Callable[[dict[str, torch.Tensor]], None]) -> Callable[[Path], None]:
    def mutate(d: Path) -> None:
        t = load_file(str(d / "model.safetensors"))
        change(t)
        save_file(t, str(d / "model.safetensors"))
    return mutate


def _truncate_weights(d: Path) -> None:
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])


def _absurd_header(d: Path) -> None:
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes((2**62).to_bytes(8, "little") + data[8:])


def _index(weight_map: object) -> Callable[[Path], None]:
    return with_file("model.safetensors.index.json", json.dumps({"metadata": {}, "weight_map": weight_map}))


def _pickle_only(d: Path) -> None:
    (d / "model.safetensors").unlink()
    (d / "pytorch_model.bin").write_bytes(b"\x80\x04pickle")


HF_CASES = {
    "layer_index_beyond_num_hidden_layers": (
        _tensors(lambda t: t.update({"model.layers.5.input_layernorm.weight": torch.ones(64)})),
        r"model.layers.5.input_layernorm.weight is for layer 5, but config.json has num_hidden_layers=2"),
    "random_bytes_safetensors": (with_file("model.safetensors", os.urandom(4096)), r"not a valid safetensors file: .*model.safetensors"),
    "truncated_safetensors": (_truncate_weights, r"not a valid safetensors file: .*(incomplete|not fully covered)"),
    "absurd_header_length": (_absurd_header, r"not a valid safetensors file: .*header too large"),
    "index_names_missing_shard": (_index({"model.embed_tokens.weight": "model-00002-of-00002.safetensors"}),
                                  r"names shard model-00002-of-00002.safetensors, which is not in"),
    "index_without_weight_map": (_index(["not", "a", "map"]), r"model.safetensors.index.json has no \"weight_map\""),
    "index_not_json": (with_file("model.safetensors.index.json", "{oops"), r"model.safetensors.index.json is not valid JSON"),
    "config_without_vocab_size": (with_config(vocab_size=None), r"config.json has no 'vocab_size'"),
    "config_negative_hidden_size": (with_config(hidden_size=-64), r"hidden_size must be an int in 1\.\.\d+, got -64"),
    "config_is_a_json_list": (with_file("config.json", json.dumps([CONFIG])), r"config.json must hold a JSON object, got a JSON list"),
    "config_not_json": (with_file("config.json", "{architectures: llama"), r"config.json is not valid JSON"),
    "config_not_utf8": (with_file("config.json", b"\xff\xfe\x00garbage"), r"cannot read .*config.json"),
    "config_vocab_size_string": (with_config(vocab_size="many"), r"'vocab_size' must be an integer, got 'many'"),
    "config_zero_heads": (with_config(num_attention_heads=0), r"num_attention_heads must be positive"),
    "config_heads_not_multiple_of_kv": (with_config(num_key_value_heads=3, head_dim=16),
                                        r"num_attention_heads \(4\) must be a multiple of num_key_value_heads \(3\)"),
    "config_zero_layers": (with_config(num_hidden_layers=0), r"num_hidden_layers must be an int in 1\.\."),
    "config_unknown_architecture": (with_config(architectures=["GPT9000ForCausalLM"]), r"unsupported architecture 'GPT9000ForCausalLM'"),
    "config_without_architectures": (with_config(architectures=None), r"config.json has no 'architectures' entry"),
    "garbage_tokenizer_json": (with_file("tokenizer.json", "\x00 this is not a tokenizer {"), r"not a valid tokenizer file: .*tokenizer.json"),
    "garbage_tokenizer_config": (with_file("tokenizer_config.json", "[[["), r"cannot read .*tokenizer_config.json"),
    "generation_config_bad_eos": (with_file("generation_config.json", json.dumps({"eos_token_id": "end"})),
                                  r"generation_config.json: eos_token_id must be a token id"),
    "missing_tensor": (_tensors(lambda t: t.pop("model.layers.1.mlp.down_proj.weight")), r"tiny.*does not cover parameter"),
    "wrong_tensor_shape": (_tensors(lambda t: t.update({"model.norm.weight": torch.ones(3)})),
                           r"model.norm.weight: checkpoint shape \(3,\) != expected \(64,\)"),
    "no_config_json": (lambda d: (d / "config.json").unlink(), r"no config.json in"),
    "pickle_only": (_pickle_only, r"only pickle checkpoints"),
}


@pytest.mark.parametrize("case", sorted(HF_CASES))
def test_broken_hf_checkpoint(case: str, tiny: Path, tmp_path: Path) -> None:
    mutate, match = HF_CASES[case]
    d = tmp_path / "tiny"
    shutil.copytree(tiny, d)
    mutate(d)
    with pytest.raises(ValueError, match=match) as info:
        LLM(model=str(d), device="cpu", num_kv_blocks=16)
    assert "\n" not in str(info.value)


# ---- broken GGUF files (copies of the default model's header) ---------------------------------------


@pytest.fixture(scope="module")
def gguf_head(smollm2_path: str) -> tuple[bytes, int]:
    """The default GGUF's first bytes (metadata, tensor infos and the first tensors) and its data offset."""
    import gguf

    data_offset = int(gguf.GGUFReader(smollm2_path, "r").data_offset)
    with open(smollm2_path, "rb") as f:
        return f.read(data_offset + 4096), data_offset


GGUF_CASES = {
    "tensor_data_past_end_of_file": (lambda b, off: b[: off + 1000], r"tensor 'token_embd.weight' data offset past end of file"),
    "truncated_in_metadata": (lambda b, off: b[:100_000], r"'tokenizer.ggml.tokens' string array runs past the end of the file"),
    "truncated_in_tensor_infos": (lambda b, off: b[: off - 10], r"runs past the end of the file .*truncated or corrupt"),
    "bad_magic": (lambda b, off: b"GGUX" + b[4:off], r"no GGUF magic number"),
    "bad_version": (lambda b, off: b[:4] + (99).to_bytes(4, "little") + b[8:off], r"unsupported GGUF version 99"),
    "absurd_tensor_count": (lambda b, off: b[:8] + (2**60).to_bytes(8, "little") + b[16:off], r"the header claims 1152921504606846976 tensors"),
    "ten_bytes": (lambda b, off: b[:10], r"only 10 bytes"),
    "text_file": (lambda b, off: b"hello, this is not a model at all\n" * 4, r"no GGUF magic number"),
}


@pytest.mark.parametrize("case", sorted(GGUF_CASES))
def test_broken_gguf(case: str, gguf_head: tuple[bytes, int], tmp_path: Path) -> None:
    make, match = GGUF_CASES[case]
    path = tmp_path / "broken.gguf"
    path.write_bytes(make(*gguf_head))
    with pytest.raises(ValueError, match=match) as info:
        LLM(model=str(path), device="cpu")
    assert "\n" not in str(info.value)
    assert "index 0 is out of bounds" not in str(info.value)


def write_gguf(path: Path, extra_layers: tuple[int, ...] = (), skip: tuple[str, ...] = (), head_count_kv: int = 2,
               tokenizer_model: str = "gpt2") -> None:
    """A tiny one-layer llama GGUF (float32 tensors, a 96-token byte-level vocabulary)."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), "llama")
    if "block_count" not in skip:
        w.add_block_count(1)
    if "embedding_length" not in skip:
        w.add_embedding_length(64)
    w.add_feed_forward_length(96)
    w.add_head_count(4)
    w.add_head_count_kv(head_count_kv)
    w.add_context_length(128)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model(tokenizer_model)
    if "tokens" not in skip:
        w.add_token_list([chr(c) for c in range(33, 33 + 96)])
        w.add_token_types([1] * 96)
    w.add_token_merges([])
    w.add_eos_token_id(2)
    rng = np.random.default_rng(0)

    def tensor(name: str, *shape: int) -> None:
        w.add_tensor(name, (rng.standard_normal(shape) * 0.1).astype(np.float32))

    tensor("token_embd.weight", 96, 64)
    tensor("output_norm.weight", 64)
    tensor("output.weight", 96, 64)
    for i in (0, *extra_layers):
        p = f"blk.{i}."
        for name, shape in [("attn_norm", (64,)), ("ffn_norm", (64,)), ("attn_q", (64, 64)), ("attn_k", (32, 64)),
                            ("attn_v", (32, 64)), ("attn_output", (64, 64)), ("ffn_gate", (96, 64)),
                            ("ffn_up", (96, 64)), ("ffn_down", (64, 96))]:
            tensor(p + name + ".weight", *shape)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


GGUF_METADATA_CASES = {
    "tensor_for_layer_beyond_block_count": (dict(extra_layers=(3,)),
                                            r"GGUF tensor blk.3.attn_norm.weight is for layer 3, but the model has 1 layers"),
    "no_block_count": (dict(skip=("block_count",)), r"GGUF metadata has no llama.block_count"),
    "no_embedding_length": (dict(skip=("embedding_length",)), r"GGUF metadata has no llama.embedding_length"),
    "no_vocabulary": (dict(skip=("tokens",)), r"GGUF metadata has no tokenizer.ggml.tokens"),
    "kv_heads_not_dividing": (dict(head_count_kv=3), r"num_attention_heads \(4\) must be a multiple of num_key_value_heads \(3\)"),
    "sentencepiece_tokenizer": (dict(tokenizer_model="llama"), r"GGUF tokenizer model 'llama' is not supported"),
}


@pytest.mark.parametrize("case", sorted(GGUF_METADATA_CASES))
def test_bad_gguf_metadata(case: str, tmp_path: Path) -> None:
    kwargs, match = GGUF_METADATA_CASES[case]
    path = tmp_path / "tiny.gguf"
    write_gguf(path, **kwargs)
    with pytest.raises(ValueError, match=match) as info:
        LLM(model=str(path), device="cpu", num_kv_blocks=16)
    assert str(path) in str(info.value) and "\n" not in str(info.value)


def test_tiny_gguf_loads(tmp_path: Path) -> None:
    """The control for the cases above: the same writer's unbroken file loads and generates."""
    path = tmp_path / "tiny.gguf"
    write_gguf(path)
    out = LLM(model=str(path), device="cpu", num_kv_blocks=16).generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=2),
                                                                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2
