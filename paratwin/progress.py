"""A quiet progress line on stderr: on a terminal, once a task has run for a second."""

from __future__ import annotations

import sys
import time


class Progress:
    """``update(done, total, what)`` redraws at most 5 times a second after the first second."""

    def __init__(self, label: str, stream=None, delay_s: float = 1.0):
        # stderr as it is now, not as it was at import (a test's capture may have replaced it)
        stream = sys.stderr if stream is None else stream
        self.label, self.stream, self.delay = label, stream, delay_s
        self.t0 = time.perf_counter()
        self.last = 0.0
        self.shown = False
        try:
            self.enabled = hasattr(stream, "isatty") and stream.isatty()
        except ValueError:  # a closed stream: nothing to draw on
            self.enabled = False

    def update(self, done: float, total: float, what: str = "") -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if now - self.t0 < self.delay or (now - self.last < 0.2 and done < total):
            return
        self.last = now
        frac = done / total if total else 1.0
        bar = "#" * int(frac * 24)
        self.stream.write(f"\r{self.label} [{bar:<24}] {frac:6.1%} {what} "
                          f"{now - self.t0:5.1f}s ")
        self.stream.flush()
        self.shown = True

    def close(self) -> None:
        if self.shown:
            self.stream.write("\n")
            self.stream.flush()
