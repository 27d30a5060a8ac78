"""`python -m pyengine.generate` as a user runs it: a subprocess on the embedded SmolLM2 GGUF.

Every subprocess imports torch, and the happy paths load the model, so the runs are few and share
work: the bad-argument cases that the CLI rejects before loading a model are cheap.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from pyengine.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parent.parent
MAX_TOKENS = 8
HAPPY_PROMPT = "What is the capital of France?"


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str


def cli(*args: str, timeout: float = 600) -> Result:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "-m", "pyengine.generate", "--device", "cpu", *args], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=timeout)
    return Result(p.returncode, p.stdout, p.stderr)


def assert_usage_error(r: Result, *words: str) -> str:
    """Exit 2, exactly one stderr line starting with 'error:' (besides the loading notice of a
    slow load: pyengine/loader/notice.py), no traceback; returns the line."""
    lines = [line for line in r.stderr.splitlines() if not line.startswith("pyengine: loading ")]
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("error: "), r.stderr
    assert "Traceback" not in r.stderr + r.stdout
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_path: str) -> Tokenizer:
    """The GGUF's tokenizer alone (metadata only, no weights): the reference for prompt lengths."""
    from pyengine.loader.gguf_file import _open, read_fields

    return Tokenizer.from_gguf_fields(read_fields(_open(smollm2_path)))


def chat_len(tok: Tokenizer, prompt: str) -> int:
    return len(tok.encode(tok.apply_chat_template([{"role": "user", "content": prompt}]), add_special_tokens=False))


@pytest.fixture(scope="module")
def happy(smollm2_path: str) -> Result:
    return cli("--prompt", HAPPY_PROMPT, "--max-tokens", str(MAX_TOKENS))


# ---- happy paths (each loads the model) ------------------------------------------------------------


def test_happy_path_streams_text_and_stats(happy: Result) -> None:
    assert happy.returncode == 0, happy.stderr
    assert happy.stdout.strip(), "no generated text on stdout"
    assert "Traceback" not in happy.stderr
    last = happy.stderr.strip().splitlines()[-1]
    for word in ("tok/s", "steps", "preemptions", "prefix-cache hit tokens"):
        assert word in last, (word, last)


def test_json_batch_from_flags_and_file(happy: Result, smollm2_tokenizer: Tokenizer, tmp_path: Path) -> None:
    file_prompts = ["Name a colour.", "Count to three."]
    pf = tmp_path / "prompts.txt"
    pf.write_text(file_prompts[0] + "\n\n" + file_prompts[1] + "\n", encoding="utf-8")  # blank lines skipped
    flag_prompts = [HAPPY_PROMPT, "Say hello."]
    r = cli("--json", "--max-tokens", str(MAX_TOKENS), "--prompt", flag_prompts[0], "--prompt", flag_prompts[1],
            "--prompts-file", str(pf))
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)  # exactly one JSON document, nothing else on stdout
    prompts = flag_prompts + file_prompts
    outs, stats = doc["outputs"], doc["stats"]
    assert [o["prompt"] for o in outs] == prompts
    for o in outs:
        assert 1 <= len(o["token_ids"]) <= MAX_TOKENS
        assert o["finish_reason"] in ("stop", "length")
        if o["finish_reason"] == "length":
            assert len(o["token_ids"]) == MAX_TOKENS
        else:  # "stop": the model said an end-of-sequence token, possibly as its last allowed one
            assert o["token_ids"][-1] in smollm2_tokenizer.eos_token_ids
        assert o["text"] == smollm2_tokenizer.decode(o["token_ids"])
    assert stats["generated_tokens"] == sum(len(o["token_ids"]) for o in outs)
    assert stats["prompt_tokens"] == sum(chat_len(smollm2_tokenizer, p) for p in prompts)  # chat is the default
    for key in ("num_steps", "num_preemptions", "prefix_cache_hit_tokens", "decode_tokens_per_s"):
        assert key in stats
    # Greedy: the same prompt in a batch says what it said alone (streamed) in the happy path.
    assert happy.returncode == 0
    assert outs[0]["text"].strip() == happy.stdout.strip()


def test_no_chat_uses_the_raw_prompt(smollm2_tokenizer: Tokenizer) -> None:
    prompts = ["The capital of France is", "One, two, three,"]
    r = cli("--json", "--no-chat", "--max-tokens", str(MAX_TOKENS), "--prompt", prompts[0], "--prompt", prompts[1])
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    raw = [len(smollm2_tokenizer.encode(p)) for p in prompts]
    assert doc["stats"]["prompt_tokens"] == sum(raw)
    assert sum(raw) < sum(chat_len(smollm2_tokenizer, p) for p in prompts)  # the check can tell them apart
    assert [o["prompt"] for o in doc["outputs"]] == prompts


def test_prompt_too_long(smollm2_path: str) -> None:
    r = cli("--max-model-len", "32", "--max-tokens", str(MAX_TOKENS), "--no-chat", "--prompt", "word " * 40)
    assert_usage_error(r, "prompt 0 is too long", "max_model_len 32")


# ---- bad model files (torch is imported, no model is loaded) ------------------------------------------


def test_missing_model_file(tmp_path: Path) -> None:
    assert_usage_error(cli("--model", str(tmp_path / "nope.gguf")), "not found", "nope.gguf")


def test_corrupt_gguf(tmp_path: Path) -> None:
    bad = tmp_path / "garbage.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(256))
    assert_usage_error(cli("--model", str(bad), "--max-tokens", "4"), "GGUF", "garbage.gguf")


def test_pickle_only_directory(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    assert_usage_error(cli("--model", str(tmp_path), "--max-tokens", "4"), "pickle")


def test_unknown_architecture(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    config = dict(architectures=["FooForCausalLM"], model_type="foo", vocab_size=32, hidden_size=16,
                  intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                  max_position_embeddings=64)
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file({"model.embed_tokens.weight": torch.zeros(32, 16)}, str(tmp_path / "model.safetensors"))
    assert_usage_error(cli("--model", str(tmp_path), "--max-tokens", "4"), "FooForCausalLM")


# ---- bad arguments (rejected before any model is loaded) ----------------------------------------------


@pytest.mark.parametrize("args,words", [
    (["--prompt", "   "], ["prompt 0 is empty"]),
    (["--prompt", "hi", "--prompt", ""], ["prompt 1 is empty"]),
    (["--max-tokens", "0"], ["max_tokens"]),
    (["--max-tokens", "many"], ["--max-tokens"]),
    (["--temperature", "-1"], ["temperature"]),
    (["--top-p", "0"], ["top_p"]),
    (["--device", "tpu"], ["--device", "tpu"]),
    (["--spec", "ngram", "--num-spec-tokens", "0"], ["num_speculative_tokens"]),
    (["--spec", "draft"], ["--draft-model"]),
    (["--spec", "mtp", "--draft-model", "x"], ["--draft-model", "--spec mtp"]),
    (["--spec", "mtp"], ["MTP speculation needs"]),  # the default GGUF model has no MTP layers
    (["--no-such-flag"], ["--no-such-flag"]),
], ids=["blank_prompt", "empty_second_prompt", "max_tokens_0", "max_tokens_nan", "temperature_neg", "top_p_0",
        "device_tpu", "num_spec_tokens_0", "draft_without_model", "mtp_with_draft_model", "mtp_without_mtp_layers",
        "unknown_flag"])
def test_bad_arguments(args: list[str], words: list[str]) -> None:
    assert_usage_error(cli(*args), *words)


def test_bad_prompts_file(tmp_path: Path) -> None:
    assert_usage_error(cli("--prompts-file", str(tmp_path / "missing.txt")), "--prompts-file", "missing.txt")
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n", encoding="utf-8")
    assert_usage_error(cli("--prompts-file", str(empty)), "no prompts")


# ---- a request that fails while it runs (issue 18: non-finite logits) ----------------------------------

# The CLI's main() on an LLM whose embedding of one token (argv[1]) is NaN: a request whose prompt
# holds that token gets NaN logits. (The tied SmolLM2 embeds from lm_head's dense columns; the
# logits read the packed copy, or a copy of their own where nothing was packed.)
POISONED_CLI = """
import sys, torch, pyengine
from pyengine.engine.llm import LLM
from pyengine.entrypoints.generate import main

class PoisonedLLM(LLM):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        m = self.model
        with torch.no_grad():
            if m.embed_tokens is not None:
                m.embed_tokens[int(sys.argv[1])] = float("nan")
            elif hasattr(m.embedding_columns, "packed"):  # rows read from the packed lm_head
                gather, bad = m.embedding_columns.gather, int(sys.argv[1])
                m.embedding_columns.gather = lambda ids: gather(ids).masked_fill((ids == bad)[:, None], float("nan"))
            elif m.embedding_columns is not None:  # the tied table kept as int8 codes + scales
                m.embedding_columns.scales[..., int(sys.argv[1])] = float("nan")
            else:
                if m.packed_lm_head is None:
                    m.packed_lm_head = m.lm_head.detach().clone()
                m.lm_head[:, int(sys.argv[1])] = float("nan")

pyengine.LLM = PoisonedLLM
main(sys.argv[2:])
"""


def poisoned_cli(token: int, *args: str, timeout: float = 600) -> Result:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "-c", POISONED_CLI, str(token), "--device", "cpu", *args], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=timeout)
    return Result(p.returncode, p.stdout, p.stderr)


def error_lines(r: Result) -> list[str]:
    return [line for line in r.stderr.splitlines() if line.startswith("error:")]


def test_a_request_with_non_finite_logits_exits_1(smollm2_tokenizer: Tokenizer) -> None:
    """Two prompts, the first holding the poisoned token: exit 1, one stderr line naming request 0
    (after the outputs), no traceback; the JSON still has both outputs, the second one complete."""
    prompts = ["Name a colour.", "Count to three."]
    chats = [smollm2_tokenizer.encode(smollm2_tokenizer.apply_chat_template([{"role": "user", "content": p}]),
                                      add_special_tokens=False) for p in prompts]
    token = next(t for t in chats[0] if t not in chats[1])
    r = poisoned_cli(token, "--json", "--max-tokens", str(MAX_TOKENS), "--prompt", prompts[0], "--prompt", prompts[1])
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr + r.stdout
    assert error_lines(r) == ["error: request 0: non-finite logits at output position 0"], r.stderr
    assert r.stderr.splitlines()[-1] == error_lines(r)[0]
    outs = json.loads(r.stdout)["outputs"]
    assert [(o["finish_reason"], o["error"], o["token_ids"]) for o in outs[:1]] == [
        ("error", "request 0: non-finite logits at output position 0", [])]
    assert outs[1]["error"] is None and outs[1]["finish_reason"] in ("stop", "length")
    assert 1 <= len(outs[1]["token_ids"]) <= MAX_TOKENS
    assert outs[1]["text"] == smollm2_tokenizer.decode(outs[1]["token_ids"])
    # text mode, one prompt (streamed): the same single line, exit 1
    r = poisoned_cli(token, "--max-tokens", str(MAX_TOKENS), "--prompt", prompts[0])
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr + r.stdout
    assert error_lines(r) == ["error: request 0: non-finite logits at output position 0"], r.stderr


def test_a_request_refused_at_admission_is_bad_input(smollm2_path: str) -> None:
    """A request that can never run (a KV pool of one block) is still bad input: exit 2."""
    assert_usage_error(cli("--num-kv-blocks", "1", "--max-tokens", str(MAX_TOKENS), "--prompt", HAPPY_PROMPT),
                       "request 0")


def test_no_progress_bar_when_stderr_is_not_a_terminal() -> None:
    """Several prompts to a pipe (a log file, CI): the answers, and no progress-bar redraws."""
    r = cli("--max-tokens", "4", "--prompt", "Say hi.", "--prompt", "Say bye.")
    assert r.returncode == 0, r.stderr
    assert "Generating" not in r.stderr and "\r" not in r.stderr, r.stderr
