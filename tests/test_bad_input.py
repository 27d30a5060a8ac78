"""Issue 23, "Bad input, everywhere": what a new user gets wrong gets one line naming the argument or
file and the problem: a ValueError from the API (LLM(...), SamplingParams(...), LLM.generate/chat),
exit code 2 and one stderr line from the CLI; never a traceback.

The broken models are tiny checkpoints written here (no transformers import: the tensors are made
directly), and truncated / corrupted copies of the default GGUF's header. The CLI cases call
pyengine.entrypoints.generate.main(argv) in-process; two run `python -m pyengine.generate` as a user
does.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers

from pyengine import LLM, SamplingParams
from pyengine.entrypoints.generate import main as cli_main

REPO = Path(__file__).resolve().parent.parent
VOCAB = 96
CONFIG = dict(architectures=["LlamaForCausalLM"], vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False, eos_token_id=2,
              bos_token_id=1)
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} {% endfor %}"


def write_checkpoint(path: Path, vocab: int = VOCAB, token_prefix: str = "t") -> None:
    """A tiny random Llama in HF layout: config.json, model.safetensors, tokenizer files."""
    path.mkdir(parents=True)
    cfg = dict(CONFIG, vocab_size=vocab)
    (path / "config.json").write_text(json.dumps(cfg))
    h, inter, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    hq, hkv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    g = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.1

    tensors = {"model.embed_tokens.weight": rand(vocab, h), "model.norm.weight": torch.ones(h),
               "lm_head.weight": rand(vocab, h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors.update({p + "input_layernorm.weight": torch.ones(h), p + "post_attention_layernorm.weight": torch.ones(h),
                        p + "self_attn.q_proj.weight": rand(hq, h), p + "self_attn.k_proj.weight": rand(hkv, h),
                        p + "self_attn.v_proj.weight": rand(hkv, h), p + "self_attn.o_proj.weight": rand(h, hq),
                        p + "mlp.gate_proj.weight": rand(inter, h), p + "mlp.up_proj.weight": rand(inter, h),
                        p + "mlp.down_proj.weight": rand(h, inter)})
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    tok = HFTokenizer(models.WordLevel(vocab={f"{token_prefix}{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "t2", "bos_token": "t1",
                                                            "chat_template": CHAT_TEMPLATE}))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("bad_input") / "tiny"
    write_checkpoint(path)
    return path


@pytest.fixture(scope="module")
def other_vocab(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("bad_input") / "vocab128"
    write_checkpoint(path, vocab=128)
    return path


@pytest.fixture(scope="module")
def llm(tiny: Path) -> LLM:
    return LLM(model=str(tiny), device="cpu", num_kv_blocks=32, max_num_seqs=4)


# ---- broken HF checkpoints ---------------------------------------------------------------------------


def _config(**changes: object) -> Callable[[Path], None]:
    def mutate(d: Path) -> None:
        cfg = json.loads((d / "config.json").read_text())
        for k, v in changes.items():
            if v is None:
                cfg.pop(k)
            else:
                cfg[k] = v
        (d / "config.json").write_text(json.dumps(cfg))
    return mutate


def _tensors(change: Callable[[dict[str, torch.Tensor]], None]) -> Callable[[Path], None]:
    def mutate(d: Path) -> None:
        t = load_file(str(d / "model.safetensors"))
        change(t)
        save_file(t, str(d / "model.safetensors"))
    return mutate


def _write(name: str, data: bytes | str) -> Callable[[Path], None]:
    def mutate(d: Path) -> None:
        (d / name).write_bytes(data if isinstance(data, bytes) else data.encode())
    return mutate


def _truncate_weights(d: Path) -> None:
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])


def _absurd_header(d: Path) -> None:
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes((2**62).to_bytes(8, "little") + data[8:])


def _index(weight_map: object) -> Callable[[Path], None]:
    return _write("model.safetensors.index.json", json.dumps({"metadata": {}, "weight_map": weight_map}))


def _pickle_only(d: Path) -> None:
    (d / "model.safetensors").unlink()
    (d / "pytorch_model.bin").write_bytes(b"\x80\x04pickle")


HF_CASES = {
    "layer_index_beyond_num_hidden_layers": (
        _tensors(lambda t: t.update({"model.layers.5.input_layernorm.weight": torch.ones(64)})),
        r"model.layers.5.input_layernorm.weight is for layer 5, but config.json has num_hidden_layers=2"),
    "random_bytes_safetensors": (_write("model.safetensors", os.urandom(4096)), r"not a valid safetensors file: .*model.safetensors"),
    "truncated_safetensors": (_truncate_weights, r"not a valid safetensors file: .*(incomplete|not fully covered)"),
    "absurd_header_length": (_absurd_header, r"not a valid safetensors file: .*header too large"),
    "index_names_missing_shard": (_index({"model.embed_tokens.weight": "model-00002-of-00002.safetensors"}),
                                  r"names shard model-00002-of-00002.safetensors, which is not in"),
    "index_without_weight_map": (_index(["not", "a", "map"]), r"model.safetensors.index.json has no \"weight_map\""),
    "index_not_json": (_write("model.safetensors.index.json", "{oops"), r"model.safetensors.index.json is not valid JSON"),
    "config_without_vocab_size": (_config(vocab_size=None), r"config.json has no 'vocab_size'"),
    "config_negative_hidden_size": (_config(hidden_size=-64), r"hidden_size must be an int in 1\.\.\d+, got -64"),
    "config_is_a_json_list": (_write("config.json", json.dumps([CONFIG])), r"config.json must hold a JSON object, got a JSON list"),
    "config_not_json": (_write("config.json", "{architectures: llama"), r"config.json is not valid JSON"),
    "config_not_utf8": (_write("config.json", b"\xff\xfe\x00garbage"), r"cannot read .*config.json"),
    "config_vocab_size_string": (_config(vocab_size="many"), r"'vocab_size' must be an integer, got 'many'"),
    "config_zero_heads": (_config(num_attention_heads=0), r"num_attention_heads must be positive"),
    "config_heads_not_multiple_of_kv": (_config(num_key_value_heads=3, head_dim=16),
                                        r"num_attention_heads \(4\) must be a multiple of num_key_value_heads \(3\)"),
    "config_zero_layers": (_config(num_hidden_layers=0), r"num_hidden_layers must be an int in 1\.\."),
    "config_unknown_architecture": (_config(architectures=["GPT9000ForCausalLM"]), r"unsupported architecture 'GPT9000ForCausalLM'"),
    "config_without_architectures": (_config(architectures=None), r"config.json has no 'architectures' entry"),
    "garbage_tokenizer_json": (_write("tokenizer.json", "\x00 this is not a tokenizer {"), r"not a valid tokenizer file: .*tokenizer.json"),
    "garbage_tokenizer_config": (_write("tokenizer_config.json", "[[["), r"cannot read .*tokenizer_config.json"),
    "generation_config_bad_eos": (_write("generation_config.json", json.dumps({"eos_token_id": "end"})),
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


# ---- LLM(...) arguments --------------------------------------------------------------------------------


LLM_CASES = {
    "enable_prefix_caching_str": (dict(enable_prefix_caching="no"), r"enable_prefix_caching must be a bool"),
    "enforce_eager_int": (dict(enforce_eager=1), r"enforce_eager must be a bool"),
    "gpu_memory_utilization_str": (dict(gpu_memory_utilization="x"), r"gpu_memory_utilization must be a number in \(0, 1\]"),
    "gpu_memory_utilization_big": (dict(gpu_memory_utilization=1.5), r"gpu_memory_utilization must be a number in \(0, 1\]"),
    "seed_2_64": (dict(seed=2**64), r"seed must be an int in \[-2\*\*63, 2\*\*64\)"),
    "seed_str": (dict(seed="7"), r"seed must be an int"),
    "max_num_seqs_1e11_int": (dict(max_num_seqs=10**11), r"max_num_seqs must be at most 65536"),
    "max_num_seqs_1e11_float": (dict(max_num_seqs=1e11), r"max_num_seqs must be a positive int"),
    "block_size_zero": (dict(block_size=0), r"block_size must be a positive int"),
    "num_kv_blocks_2_40": (dict(num_kv_blocks=2**40), r"num_kv_blocks must be at most 2147483647"),
    "max_model_len_huge": (dict(max_model_len=10**12), r"max_model_len must be at most"),
    "prompt_lookup_max_2_40": (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2**40}),
                               r"speculative_config.prompt_lookup_max must be an int in 1\.\.2147483647"),
    "prompt_lookup_min_str": (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": "2"}),
                              r"speculative_config.prompt_lookup_min must be an int"),
    "num_speculative_tokens_zero": (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 0}),
                                    r"num_speculative_tokens must be an int in 1\.\.32"),
    "speculative_unknown_key": (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2, "k": 3}),
                                r"unknown keys \['k'\]"),
    "speculative_method": (dict(speculative_config={"method": "eagle", "num_speculative_tokens": 2}),
                           r"method must be 'ngram', 'suffix', 'draft_model', 'mtp' or 'eagle3'"),
    "mtp_with_model": (dict(speculative_config={"method": "mtp", "num_speculative_tokens": 2, "model": "x"}),
                       r"speculative_config.model is not used by method 'mtp'"),
    "mtp_without_mtp_layers": (dict(speculative_config={"method": "mtp", "num_speculative_tokens": 2}),
                               r"speculative method 'mtp' needs a model with MTP layers; LlamaForCausalLM has no MTP"),
    "speculative_model_not_str": (dict(speculative_config={"model": 5, "num_speculative_tokens": 2}),
                                  r"speculative_config.model must be a path"),
    "model_not_str": (dict(model=123), r"model must be a path \(str\) or None"),
    "dtype": (dict(dtype="int8"), r"dtype must be 'auto' or one of"),
    "device": (dict(device="tpu"), r"device must be 'auto', 'cpu' or 'cuda'"),
}


@pytest.mark.parametrize("case", sorted(LLM_CASES))
def test_llm_arguments(case: str, tiny: Path) -> None:
    kwargs, match = LLM_CASES[case]
    kwargs = {"model": str(tiny), "device": "cpu", **kwargs}
    with pytest.raises(ValueError, match=match):
        LLM(**kwargs)


def test_num_kv_blocks_beyond_memory_says_what_it_needs(tiny: Path) -> None:
    with pytest.raises(ValueError, match=r"num_kv_blocks=100000000 needs [0-9.]+ GiB of KV cache .*more than"):
        LLM(model=str(tiny), device="cpu", num_kv_blocks=100_000_000)


def test_missing_model_path(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="model file not found"):
        LLM(model=str(tmp_path / "nowhere"), device="cpu")


def test_draft_model_with_another_vocabulary_is_refused_at_load(tiny: Path, other_vocab: Path) -> None:
    with pytest.raises(ValueError, match=r"draft model .*vocab128 has a vocabulary of 128 tokens, the target model 96"):
        LLM(model=str(tiny), device="cpu", num_kv_blocks=16,
            speculative_config={"model": str(other_vocab), "num_speculative_tokens": 2})


def test_draft_model_with_another_tokenizer_of_the_same_size_is_refused_at_load(tiny: Path, tmp_path: Path) -> None:
    other = tmp_path / "other_tokens"
    write_checkpoint(other, token_prefix="w")  # 96 tokens too, other texts
    with pytest.raises(ValueError, match=r"draft model .*other_tokens has another tokenizer than the target model "
                                         r"\(token id 0 is 'w0' there, 't0' here\)"):
        LLM(model=str(tiny), device="cpu", num_kv_blocks=16,
            speculative_config={"model": str(other), "num_speculative_tokens": 2})


# ---- SamplingParams(...) ---------------------------------------------------------------------------------


SAMPLING_CASES = {
    "stop_token_ids_2_40": (dict(stop_token_ids=[2**40]), r"stop_token_ids must be a list of token ids \(ints in 0\.\.2147483647\)"),
    "stop_token_ids_negative": (dict(stop_token_ids=[-1]), r"stop_token_ids must be a list of token ids"),
    "seed_2_64": (dict(seed=2**64), r"seed must be None or an int in \[-2\*\*63, 2\*\*64\)"),
    "seed_float": (dict(seed=1.5), r"seed must be None or an int"),
    "temperature_negative": (dict(temperature=-1), r"temperature must be a finite number >= 0"),
    "temperature_nan": (dict(temperature=float("nan")), r"temperature must be a finite number"),
    "top_p_zero": (dict(top_p=0), r"top_p must be in \(0, 1\]"),
    "top_k_zero": (dict(top_k=0), r"top_k must be -1"),
    "max_tokens_zero": (dict(max_tokens=0), r"max_tokens must be an int in 1\.\."),
    "max_tokens_2_63": (dict(max_tokens=2**63), r"max_tokens must be an int in 1\.\.2\*\*63-1"),
    "stop_empty": (dict(stop=""), r"stop must not contain empty strings"),
    "stop_int": (dict(stop=5), r"stop must be a str or a list of str"),
    "ignore_eos_str": (dict(ignore_eos="yes"), r"ignore_eos must be a bool"),
}


@pytest.mark.parametrize("case", sorted(SAMPLING_CASES))
def test_sampling_params(case: str) -> None:
    kwargs, match = SAMPLING_CASES[case]
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


# ---- LLM.generate / LLM.chat -----------------------------------------------------------------------------


CALL_CASES = {
    "empty_prompt": (lambda llm: llm.generate("", use_tqdm=False), r"prompt 0 is empty"),
    "no_prompts": (lambda llm: llm.generate([], use_tqdm=False), r"prompts must be a str"),
    "prompt_not_str": (lambda llm: llm.generate([3.5], use_tqdm=False), r"prompt 0 must be a non-empty str"),
    "params_count": (lambda llm: llm.generate(["t3", "t4"], [SamplingParams(), SamplingParams(), SamplingParams()],
                                              use_tqdm=False), r"sampling_params must be one SamplingParams or a list of 2"),
    "chat_without_content": (lambda llm: llm.chat([{"role": "user"}], use_tqdm=False), r"messages\[0\] has no 'content'"),
    "chat_without_role": (lambda llm: llm.chat([{"content": "t3"}], use_tqdm=False), r"messages\[0\] has no 'role'"),
    "chat_content_not_str": (lambda llm: llm.chat([{"role": "user", "content": 5}], use_tqdm=False),
                             r"messages\[0\]\['content'\] must be a string"),
    "chat_second_message_str": (lambda llm: llm.chat([{"role": "user", "content": "t3"}, "t4"], use_tqdm=False),
                                r"messages\[1\] must be a dict"),
    "chat_empty": (lambda llm: llm.chat([], use_tqdm=False), r"messages must be a non-empty list"),
}


@pytest.mark.parametrize("case", sorted(CALL_CASES))
def test_generate_and_chat(case: str, llm: LLM) -> None:
    call, match = CALL_CASES[case]
    with pytest.raises(ValueError, match=match):
        call(llm)


def test_chat_template_that_reads_a_missing_field(llm: LLM) -> None:
    """A template reading a field the messages lack is a ValueError, not jinja's UndefinedError."""
    tok = llm.tokenizer
    saved, tok.chat_template, tok._template = tok.chat_template, "{{ messages[0]['content'].missing.deeper }}", None
    try:
        with pytest.raises(ValueError, match=r"chat template error: .*has no attribute 'missing'"):
            llm.chat([{"role": "user", "content": "t3"}], use_tqdm=False)
    finally:
        tok.chat_template, tok._template = saved, None


# ---- the CLI: exit 2, one stderr line, no traceback ------------------------------------------------------


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as info:
        cli_main(["--device", "cpu", *argv])
    out = capsys.readouterr()
    lines = out.err.splitlines()
    assert info.value.code == 2, out.err
    assert len(lines) == 1 and lines[0].startswith("error: "), out.err
    assert "Traceback" not in out.err + out.out
    return lines[0]


def _not_utf8(tmp: Path, tiny: Path, other: Path) -> list[str]:
    (tmp / "prompts.txt").write_bytes(b"caf\xe9 au lait\n\xff\xfe\n")
    return ["--model", str(tiny), "--prompts-file", str(tmp / "prompts.txt")]


def _bad_jsonl(tmp: Path, tiny: Path, other: Path) -> list[str]:
    (tmp / "p.jsonl").write_text('{"prompt": "t3"}\n{"prompt": 5}\n')
    return ["--model", str(tiny), "--prompts-file", str(tmp / "p.jsonl")]


def _broken_model(tmp: Path, tiny: Path, other: Path) -> list[str]:
    d = tmp / "m"
    shutil.copytree(tiny, d)
    _config(vocab_size=None)(d)
    return ["--model", str(d), "--prompt", "t3"]


def _truncated_gguf(tmp: Path, tiny: Path, other: Path) -> list[str]:
    (tmp / "m.gguf").write_bytes(b"GGUF" + (3).to_bytes(4, "little") + (5).to_bytes(8, "little") + (1).to_bytes(8, "little")
                                 + (2**40).to_bytes(8, "little"))
    return ["--model", str(tmp / "m.gguf"), "--prompt", "t3"]


CLI_CASES = {
    "prompts_file_not_utf8": (_not_utf8, r"cannot read --prompts-file .*prompts.txt.*utf-8"),
    "prompts_file_missing": (lambda tmp, t, o: ["--prompts-file", str(tmp / "none.txt")], r"cannot read --prompts-file"),
    "prompts_file_bad_jsonl": (_bad_jsonl, r"p.jsonl line 2: needs a \"prompt\" string"),
    "config_without_vocab_size": (_broken_model, r"config.json has no 'vocab_size'"),
    "truncated_gguf": (_truncated_gguf, r"not a valid GGUF file: .*m.gguf \(metadata key 0 .*runs past the end of the file"),
    "num_kv_blocks_1e8": (lambda tmp, t, o: ["--model", str(t), "--num-kv-blocks", "100000000", "--prompt", "t3"],
                          r"num_kv_blocks=100000000 needs [0-9.]+ GiB"),
    "max_num_seqs_1e11": (lambda tmp, t, o: ["--model", str(t), "--max-num-seqs", "1e11"],
                          r"argument --max-num-seqs: invalid int value: '1e11'"),
    "max_num_seqs_10_11": (lambda tmp, t, o: ["--model", str(t), "--max-num-seqs", str(10**11), "--prompt", "t3"],
                           r"max_num_seqs must be at most 65536"),
    "seed_2_64": (lambda tmp, t, o: ["--model", str(t), "--seed", str(2**64), "--prompt", "t3"], r"seed must be"),
    "draft_other_vocabulary": (lambda tmp, t, o: ["--model", str(t), "--spec", "draft", "--draft-model", str(o),
                                                  "--prompt", "t3"], r"draft model .* must share the target's vocabulary"),
    "temperature_negative": (lambda tmp, t, o: ["--model", str(t), "--temperature", "-1", "--prompt", "t3"],
                             r"temperature must be a finite number >= 0"),
}


@pytest.mark.parametrize("case", sorted(CLI_CASES))
def test_cli(case: str, tiny: Path, other_vocab: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    make_argv, match = CLI_CASES[case]
    line = run_cli(capsys, *make_argv(tmp_path, tiny, other_vocab))
    assert re.search(match, line), line


@pytest.mark.parametrize("case", ["broken_safetensors", "prompts_file_not_utf8"])
def test_cli_subprocess(case: str, tiny: Path, tmp_path: Path) -> None:
    """As a user runs it: `python -m pyengine.generate`, exit 2 and exactly one stderr line."""
    if case == "broken_safetensors":
        d = tmp_path / "m"
        shutil.copytree(tiny, d)
        _write("model.safetensors", os.urandom(2048))(d)
        argv, word = ["--model", str(d), "--prompt", "t3"], "not a valid safetensors file"
    else:
        argv, word = _not_utf8(tmp_path, tiny, tiny), "cannot read --prompts-file"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "-m", "pyengine.generate", "--device", "cpu", *argv], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=300)
    lines = p.stderr.splitlines()
    assert p.returncode == 2, p.stderr
    assert len(lines) == 1 and lines[0].startswith("error: ") and word in lines[0], p.stderr
    assert "Traceback" not in p.stderr + p.stdout
