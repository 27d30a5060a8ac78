"""Issue 23, "Bad input, everywhere": what a new user gets wrong gets one line naming the argument or
file and the problem: a ValueError from the API (LLM(...), SamplingParams(...), LLM.generate/chat),
exit code 2 and one stderr line from the CLI; never a traceback. Broken model files:
test_bad_model_files.py.

The CLI cases call pyengine.entrypoints.generate.main(argv) in-process; two run
`python -m pyengine.generate` as a user does.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pyengine import LLM, SamplingParams
from pyengine.entrypoints.generate import main as cli_main
from tests.bad_input_checkpoints import with_config, with_file, write_checkpoint

REPO = Path(__file__).resolve().parent.parent


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
    "prompt_lookup_for_mtp": (dict(speculative_config={"method": "mtp", "num_speculative_tokens": 2, "prompt_lookup_min": 1}),
                              r"\['prompt_lookup_min'\] apply to methods 'ngram' and 'suffix' only"),
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
    with_config(vocab_size=None)(d)
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
        with_file("model.safetensors", os.urandom(2048))(d)
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
