"""A quiet progress line on stderr: on a terminal, once a task has run for a second."""

from __future__ import annotations

import sys
import time


class Progress:
    """``update(done, total, what)`` redraws at most 5 times a second after the first second,
    and whenever ``what`` changes (a new stage: ``total`` None draws it without a bar)."""

    def __init__(self, label: str, stream=None, delay_s: float = 1.0):
        # stderr as it is now, not as it was at import (a test's capture may have replaced it)
        stream = sys.stderr if stream is None else stream
        self.label, self.stream, self.delay = label, stream, delay_s
        self.t0 = time.perf_counter()
        self.last = 0.0
        self.what = None
        self.width = 0  # of the line drawn last: a shorter one is padded over it
        self.shown = False
        try:
            self.enabled = hasattr(stream, "isatty") and stream.isatty()
        except ValueError:  # a closed stream: nothing to draw on
            self.enabled = False

    def update(self, done: float, total: float | None, what: str = "") -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if now - self.t0 < self.delay or (now - self.last < 0.2 and what == self.what
                                          and total is not None and done < total):
            return
        self.last, self.what = now, what
        if total is None:
            line = f"{self.label} {what} {now - self.t0:5.1f}s"
        else:
            frac = done / total if total else 1.0
            line = f"{self.label} [{'#' * int(frac * 24):<24}] {frac:6.1%} {what} " \
                f"{now - self.t0:5.1f}s"
        self.stream.write(f"\r{line:<{self.width}} ")
        self.stream.flush()
        self.width = len(line)
        self.shown = True

    def close(self) -> None:
        if self.shown:
            self.stream.write("\n")
            self.stream.flush()
