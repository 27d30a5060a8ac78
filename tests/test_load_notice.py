"""The one stderr line of a load that takes longer than a moment (pyengine/loader/notice.py)."""
from __future__ import annotations

import io
import os
import time

import pytest

from pyengine.loader import notice


def test_slow_block_says_once_what_is_loading():
    out = io.StringIO()
    with notice.slow_notice("model.gguf (98 MB)", delay_s=0.02, stream=out):
        time.sleep(0.3)
    assert out.getvalue() == "pyengine: loading model.gguf (98 MB)...\n"


def test_quick_block_says_nothing_even_later():
    out = io.StringIO()
    with notice.slow_notice("model.gguf", delay_s=0.2, stream=out):
        pass
    time.sleep(0.4)  # past the delay: the timer was cancelled, not merely late
    assert out.getvalue() == ""


def test_failed_load_still_cancels():
    out = io.StringIO()
    with pytest.raises(ValueError), notice.slow_notice("x", delay_s=0.2, stream=out):
        raise ValueError("bad file")
    time.sleep(0.4)
    assert out.getvalue() == ""


def test_load_model_names_the_file_on_stderr(smollm2_path, monkeypatch, capfd):
    """A load slower than the delay (0 here) prints one line, to stderr only, naming the file."""
    from pyengine.loader import load_model

    monkeypatch.setattr(notice, "DELAY_S", 0.0)
    load_model(smollm2_path)
    captured = capfd.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == [f"pyengine: loading SmolLM2-135M-Instruct.Q4_1.gguf "
                                         f"({os.path.getsize(smollm2_path) / 1e6:.0f} MB)..."]
