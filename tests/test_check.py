"""The losslessness checker (pyengine/check.py, `python -m pyengine.check`).

The comparison rules run on synthetic rows (no model). The model tests share one loaded SmolLM2
(share_loaded_models around the module): the function on fp32 prompts must find every row
identical, and a speculative run perturbed on purpose (its logits changed at known positions
before sampling) must be reported with those positions and make the CLI exit 1; a normal CLI run
prints the table and exits 0. Bad input exits 2 (subprocesses of `python -m pyengine.check`,
which fail before importing torch).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from pyengine import check
from pyengine.check_rows import Comparison, Report, RowResult, RowRun, compare_rows, significant_bits, ulp
from pyengine.entrypoints.generate import load_prompts_file

REPO = Path(__file__).resolve().parent.parent
SPEC = {"method": "ngram", "num_speculative_tokens": 4}
# short answers; the list/count prompts give the ngram proposer drafts that get accepted
PROMPTS = ["What is the capital of France?", "Count from 1 to 10.", "List the days of the week."]
MAX_TOKENS = 16


# ---- the bound and the row comparison (no model) ----------------------------------------------------


def test_ulp_and_significant_bits() -> None:
    assert [significant_bits(d) for d in (torch.float32, torch.bfloat16, torch.float16)] == [24, 8, 11]
    assert ulp(1.0, torch.float32) == 2.0 ** -23
    assert ulp(1.0, torch.bfloat16) == 2.0 ** -7
    assert ulp(-3.5, torch.bfloat16) == 2.0 ** -6  # magnitude in [2, 4)
    assert ulp(20.0, torch.float16) == 2.0 ** -6  # [16, 32): 2**(4 - 10)
    # the ulp is the spacing of representable values there
    for x, dtype in [(13.7, torch.bfloat16), (0.3, torch.float16), (-1234.5, torch.float32)]:
        v = torch.tensor(x, dtype=dtype)
        spacing = torch.nextafter(v, torch.tensor(float("inf"), dtype=dtype)).double() - v.double()
        assert float(spacing) == ulp(x, dtype), (x, dtype)


def _row(tokens: list[int], rows: list[dict[int, float]], vocab: int = 8, **kw: Any) -> RowRun:
    """logits: each position all zeros but the given entries."""
    logits = torch.zeros(len(rows), vocab)
    for i, entries in enumerate(rows):
        for t, v in entries.items():
            logits[i, t] = v
    return RowRun(tokens, logits, kw.get("finish_reason", "length"), kw.get("error"))


def test_compare_identical_and_logits_only() -> None:
    ref = _row([1, 2, 3], [{1: 5.0}, {2: 5.0}, {3: 5.0, 4: 1.0}])
    same = _row([1, 2, 3], [{1: 5.0}, {2: 5.0}, {3: 5.0, 4: 1.0}])
    assert compare_rows(ref, same, torch.float32).status == "identical"
    c = compare_rows(ref, _row([1, 2, 3], [{1: 5.0}, {2: 5.0, 6: -0.25}, {3: 5.0, 4: 1.5}]), torch.float32)
    assert (c.status, c.first_logit_diff, c.first_token_diff, c.max_abs_logit_diff) == ("logits_differ", 1, None, 0.5)
    # -0.0 vs 0.0: equal as numbers, not in bits
    c = compare_rows(ref, _row([1, 2, 3], [{1: 5.0, 7: -0.0}, {2: 5.0}, {3: 5.0, 4: 1.0}]), torch.float32)
    assert (c.status, c.first_logit_diff, c.max_abs_logit_diff) == ("logits_differ", 0, 0.0)


def test_compare_tie_and_divergence_in_bf16() -> None:
    u = ulp(4.0, torch.bfloat16)  # 2**-5: both logits in [4, 8)
    ref = _row([1, 5, 9], [{1: 6.0}, {5: 4.0 + 3 * u, 7: 4.0 + 2 * u}, {}], vocab=10)
    # the other run: token 7 wins by one ulp (each logit moved by one ulp: swing 2 ulps) -> tie
    tie = compare_rows(ref, _row([1, 7, 2], [{1: 6.0}, {5: 4.0 + 2 * u, 7: 4.0 + 3 * u}, {}], vocab=10), torch.bfloat16)
    assert (tie.status, tie.first_token_diff, tie.first_logit_diff) == ("tie", 1, 1)
    assert (tie.ref_token, tie.other_token) == (5, 7)
    assert (tie.top2_gap, tie.swing, tie.tie_bound, tie.ulp) == (u, 2 * u, 2 * u, u)
    # logits after the token divergence (position 2: other contexts) do not count in the max difference
    assert tie.max_abs_logit_diff == u
    # a gap of two ulps closing to an exact tie (the other run's argmax picks the lower id) is a tie too
    ref2 = _row([1, 7], [{1: 6.0}, {7: 4.0 + 4 * u, 5: 4.0 + 2 * u}], vocab=10)
    c = compare_rows(ref2, _row([1, 5], [{1: 6.0}, {7: 4.0 + 3 * u, 5: 4.0 + 3 * u}], vocab=10), torch.bfloat16)
    assert (c.status, c.top2_gap, c.swing) == ("tie", 2 * u, 2 * u)
    # three ulps of swing: more than the final rounding can do -> diverged
    c = compare_rows(ref, _row([1, 7], [{1: 6.0}, {5: 4.0 + 2 * u, 7: 4.0 + 4 * u}], vocab=10), torch.bfloat16)
    assert (c.status, c.first_token_diff, c.swing) == ("diverged", 1, 3 * u)
    # in fp32 the same logits are far apart (2**-5 is 2**18 fp32 ulps)
    assert compare_rows(ref, _row([1, 7, 2], [{1: 6.0}, {5: 4.0 + 2 * u, 7: 4.0 + 3 * u}, {}], vocab=10),
                        torch.float32).status == "diverged"


def test_compare_early_stop_and_errors() -> None:
    ref = _row([1, 2, 3], [{1: 5.0}, {2: 5.0}, {3: 5.0}])
    c = compare_rows(ref, _row([1, 2], [{1: 5.0}, {2: 5.0}], finish_reason="stop"), torch.float32)
    assert (c.status, c.first_token_diff, c.first_logit_diff) == ("diverged", 2, None)
    assert "stopped at 2 tokens" in c.note
    assert compare_rows(ref, RowRun([1], None, "error", "boom"), torch.float32).status == "error"
    c = compare_rows(ref, RowRun([1, 2, 3], None, "length"), torch.float32)  # logits not recorded
    assert c.status == "error" and "record_logits" in c.note


def _report(strict: bool, *statuses: str) -> Report:
    r = Report("m", "cpu", "float32", SPEC, 4, None, strict, 24)
    r.rows = [RowResult(i, "p", 3, 4, "length", {"spec": Comparison(s, 4, 4)}) for i, s in enumerate(statuses)]
    return r


def test_report_pass_rules() -> None:
    assert _report(False, "identical", "logits_differ", "tie").exit_code == 0
    assert _report(False, "identical", "diverged").exit_code == 1
    assert _report(False, "error").exit_code == 1
    assert _report(True, "identical", "identical").exit_code == 0
    assert _report(True, "identical", "logits_differ").exit_code == 1
    assert _report(True, "tie").exit_code == 1
    text = _report(False, "identical", "diverged").format_table()
    assert "FAIL: 1 row(s)" in text and "1 identical, 1 diverged" in text
    json.dumps(_report(False, "tie").to_dict())


def test_prompt_files(tmp_path: Path) -> None:
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a"}\n\n{"turns": ["b", "second turn"], "question_id": 1}\n')
    assert load_prompts_file(str(f)) == ["a", "b"]
    t = tmp_path / "p.txt"
    t.write_text('line one\n\n{"prompt": "x"}\r\n')
    assert load_prompts_file(str(t)) == ["line one", '{"prompt": "x"}']
    f.write_text('{"prompt": "a"}\n{"turns": []}\n')
    with pytest.raises(ValueError, match="line 2"):
        load_prompts_file(str(f))
    with pytest.raises(ValueError, match="cannot read"):
        load_prompts_file(str(tmp_path / "missing.jsonl"))
    bench = Path("/work/shared/data/spec_bench_questions.jsonl")
    if bench.exists():
        prompts = load_prompts_file(str(bench))
        assert prompts and all(isinstance(p, str) and p for p in prompts)


# ---- on the model --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shared_model(smollm2_path: str):
    """Every LLM of this module's in-process checks runs one loaded model."""
    with check.share_loaded_models():
        yield


def test_spec_and_alone_are_identical_in_fp32(shared_model: None) -> None:
    report = check.check_losslessness(PROMPTS, device="cpu", dtype="float32", speculative_config=SPEC,
                                      max_tokens=MAX_TOKENS)
    table = report.format_table()
    assert report.comparison_names == ["spec", "alone"], table
    for name in ("spec", "alone"):
        assert report.counts(name)["identical"] == len(PROMPTS), table
    assert report.passed and report.exit_code == 0, table
    assert all(r.num_output_tokens > 1 for r in report.rows), table
    # not a vacuous check: the speculative run drafted, and accepted some drafts
    stats = report.runs["spec"]["stats"]
    assert stats["num_accepted_tokens"] > 0, stats


def perturb_spec_runs(monkeypatch: pytest.MonkeyPatch, edits: dict[str, tuple[int, str]]) -> None:
    """The checker's speculative engine gets its logits changed before sampling: for the request
    whose prompt contains KEY, at output position P, ("flip") the token after its argmax is made
    the argmax, or ("nudge") its smallest logit is raised by 2**-10 (its argmax unchanged)."""
    original = check._build_llm

    def build(**kwargs: Any) -> Any:
        llm = original(**kwargs)
        if kwargs.get("speculative_config") is None:
            return llm
        engine, execute = llm.engine, llm.engine.runner.execute

        def perturbed(batch: Any, *patch: Any) -> torch.Tensor:
            logits = execute(batch, *patch).clone()
            start = 0
            for r, n in enumerate(batch.num_logits.tolist()):
                req = engine.requests[int(batch.seq_ids[r])]
                done = len(req.logits)  # record_logits: one per committed output token
                for key, (pos, how) in edits.items():
                    if key in (req.prompt or "") and done <= pos < done + n:
                        row = logits[start + pos - done]
                        if how == "flip":
                            row[(int(row.argmax()) + 1) % row.numel()] = row.max() + 1.0
                        else:
                            row[int(row.argmin())] += 2.0 ** -10
                start += n
            return logits

        llm.engine.runner.execute = perturbed
        return llm

    monkeypatch.setattr(check, "_build_llm", build)


def test_perturbed_speculation_is_reported_and_fails_the_cli(shared_model: None, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    from pyengine.entrypoints.check import main

    perturb_spec_runs(monkeypatch, {PROMPTS[1]: (5, "flip"), PROMPTS[2]: (3, "nudge")})
    args = ["--device", "cpu", "--dtype", "float32", "--max-tokens", str(MAX_TOKENS), "--no-alone", "--json"]
    for p in PROMPTS:
        args += ["--prompt", p]
    rc = main(args)
    doc = json.loads(capsys.readouterr().out)
    spec = [row["comparisons"]["spec"] for row in doc["rows"]]
    assert rc == 1 and doc["passed"] is False, doc["summary"]
    assert spec[0]["status"] == "identical", spec[0]
    flipped = spec[1]
    assert (flipped["status"], flipped["first_token_diff"], flipped["first_logit_diff"]) == ("diverged", 5, 5), flipped
    assert flipped["max_abs_logit_diff"] >= 1.0 and flipped["swing"] > flipped["tie_bound"], flipped
    assert flipped["top2_gap"] > 0 and flipped["ref_token"] != flipped["other_token"], flipped
    nudged = spec[2]
    assert nudged["status"] == "logits_differ", nudged
    assert (nudged["first_logit_diff"], nudged["first_token_diff"]) == (3, None), nudged
    assert 0 < nudged["max_abs_logit_diff"] <= 2.0 ** -10 * 1.01, nudged
    assert doc["summary"]["spec"] == {"identical": 1, "logits_differ": 1, "tie": 0, "diverged": 1, "error": 0}


# ---- the CLI as a user runs it --------------------------------------------------------------------


def cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "pyengine.check", "--device", "cpu", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("args, words", [
    (["--prompts-file", "/nonexistent/prompts.txt"], ["cannot read", "prompts.txt"]),
    (["--prompts-file", "EMPTY"], ["no prompts"]),
    ([], ["no prompts"]),
    (["--prompt", "hi", "--num-spec-tokens", "0"], ["num_speculative_tokens"]),
    (["--prompt", "hi", "--spec", "draft"], ["--draft-model"]),
    (["--prompt", "hi", "--spec", "medusa"], ["--spec"]),
    (["--prompt", "hi", "--max-tokens", "0"], ["--max-tokens"]),
    (["--prompt", "hi", "--model", "/nonexistent/model.gguf"], ["not found"]),
    (["--prompts-file", "BADJSONL"], ["line 1"]),
])
def test_bad_input_exits_2_with_one_line(args: list[str], words: list[str], tmp_path: Path) -> None:
    (tmp_path / "empty.txt").write_text("\n\n")
    (tmp_path / "bad.jsonl").write_text('{"question": "no prompt field"}\n')
    args = [{"EMPTY": str(tmp_path / "empty.txt"), "BADJSONL": str(tmp_path / "bad.jsonl")}.get(a, a) for a in args]
    p = cli(*args, timeout=120)
    lines = p.stderr.splitlines()
    assert p.returncode == 2, (p.returncode, p.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: "), p.stderr
    assert "Traceback" not in p.stderr + p.stdout
    for word in words:
        assert word in lines[0], (word, lines[0])


def test_cli_prints_the_table_and_exits_0(shared_model: None, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    """In process, to share the loaded model (the subprocess tests above run the `-m` entry)."""
    from pyengine.entrypoints.check import main

    f = tmp_path / "questions.jsonl"
    f.write_text("".join(json.dumps({"turns": [p, "a second turn"]}) + "\n" for p in PROMPTS[:2]))
    rc = main(["--prompts-file", str(f), "--device", "cpu", "--dtype", "float32", "--max-tokens", "8", "--no-alone"])
    out, err = capsys.readouterr()
    assert rc == 0, out + err
    assert "losslessness check" in out and "float32 (24 significant bits)" in out, out
    for prompt in PROMPTS[:2]:
        assert prompt in out, out
    assert "a second turn" not in out, out
    assert "spec (speculative vs plain, batched): 2 identical" in out, out
    # the CPU kernels run batch-invariant by default, so the check is strict by default there
    assert "batch_invariant True; strict on" in out, out
    assert out.strip().splitlines()[-1] == "PASS (strict: every row bit-identical)", out
    assert "speculative, batched" in err  # progress lines go to stderr
