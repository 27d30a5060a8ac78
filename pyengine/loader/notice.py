"""One line on stderr when loading a model takes longer than a moment.

Nothing is printed for a load that finishes within the delay (the default model loads in about
half a second), and never more than one line: a progress bar redrawn on a non-terminal (a log
file, a pipe) becomes hundreds of lines.
"""
from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator
from typing import TextIO

DELAY_S = 0.5


@contextlib.contextmanager
def slow_notice(what: str, delay_s: float | None = None, stream: TextIO | None = None) -> Iterator[None]:
    """Runs the block; if it is still running after delay_s (default DELAY_S), writes
    "pyengine: loading {what}..." to stream (default: sys.stderr at that moment) once."""
    done = threading.Event()
    lock = threading.Lock()  # the line is written whole, and never after the block has ended

    def tell() -> None:
        with lock:
            if not done.is_set():
                out = stream or sys.stderr
                try:
                    out.write(f"pyengine: loading {what}...\n")
                    out.flush()
                except (OSError, ValueError):  # a closed or broken stderr: loading goes on regardless
                    pass

    timer = threading.Timer(DELAY_S if delay_s is None else delay_s, tell)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        with lock:
            done.set()
        timer.cancel()
