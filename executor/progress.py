"""The progress board: where each rank says what it is doing, so a watchdog can tell a hang.

One fixed-size slot per rank in a memory-mapped file of the run directory: the rank's pid,
its phase, step, op index, whether it is blocked waiting on communication, and the
CLOCK_MONOTONIC time of its last update (system-wide on one host, so the local launcher
compares it with its own clock). A rank writes its slot before every op (a 32-byte
``struct.pack_into``); the local launcher reads every slot. Under torchrun there is no
launcher on the node to watch, so each rank runs a ``SelfWatchdog`` thread over its own
slot instead and exits when it stalls (torchrun then stops the other ranks). A rank of
the local launcher runs a ``ParentWatch`` thread: it exits once the launcher is gone.
"""

from __future__ import annotations

import mmap
import os
import struct
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

SLOT = struct.Struct("<qiiiiq")  # t_ns, step, op, waiting, phase, pid
PHASES = ("starting", "init", "groups", "warmup", "measure", "writing", "done")


@dataclass(frozen=True)
class Slot:
    """One rank's last report."""

    t_ns: int
    step: int
    op: int
    waiting: bool
    phase: str
    pid: int


class Board:
    """Slots of ``world_size`` ranks in a file (``path``) or in anonymous memory (``None``)."""

    def __init__(self, world_size: int, path: str | Path | None = None, create: bool = False):
        self.world_size = world_size
        size = SLOT.size * world_size
        if path is None:
            self._mm = mmap.mmap(-1, size)
        else:
            path = Path(path)
            if create:
                path.write_bytes(b"\0" * size)
            with open(path, "r+b") as fh:
                self._mm = mmap.mmap(fh.fileno(), size)

    def write(self, rank: int, phase: str, step: int = -1, op: int = -1,
              waiting: bool = False) -> None:
        SLOT.pack_into(self._mm, rank * SLOT.size, time.monotonic_ns(), step, op, int(waiting),
                       PHASES.index(phase), os.getpid())

    def read(self, rank: int) -> Slot:
        t, step, op, waiting, phase, pid = SLOT.unpack_from(self._mm, rank * SLOT.size)
        if not t:  # never written: the rank has not started (no step 0, op 0 yet)
            step, op = -1, -1
        return Slot(t, step, op, bool(waiting), PHASES[min(max(phase, 0), len(PHASES) - 1)], pid)

    def close(self) -> None:
        self._mm.close()


class Reporter:
    """A rank's handle on its slot: cheap to call before every op."""

    def __init__(self, board: Board, rank: int):
        self.board, self.rank = board, rank
        self.phase, self.step = "starting", -1

    def set_phase(self, phase: str, step: int = -1) -> None:
        self.phase, self.step = phase, step
        self.board.write(self.rank, phase, step)

    def op(self, index: int, waiting: bool = False) -> None:
        self.board.write(self.rank, self.phase, self.step, index, waiting)


class SelfWatchdog(threading.Thread):
    """Exits the process when its own slot has not moved for ``timeout_s`` (torchrun mode).

    ``on_stall(message)`` runs first (it records the error); then ``os._exit(3)``, since a
    rank stuck inside a collective cannot be interrupted from Python.
    """

    def __init__(self, board: Board, rank: int, timeout_s: float,
                 on_stall: Callable[[str], None], describe: Callable[[Slot], str] = str):
        super().__init__(daemon=True, name="paratwin-watchdog")
        self.board, self.rank, self.timeout_s = board, rank, timeout_s
        self.on_stall, self.describe = on_stall, describe
        self._stop = threading.Event()

    def run(self) -> None:
        period = min(1.0, self.timeout_s / 10)
        while not self._stop.wait(period):
            slot = self.board.read(self.rank)
            if slot.phase == "done":
                return
            idle_s = (time.monotonic_ns() - slot.t_ns) / 1e9
            if slot.t_ns and idle_s > self.timeout_s:
                msg = (f"rank {self.rank} made no progress for {idle_s:.1f} s "
                       f"({self.describe(slot)}); exiting after timeout_s={self.timeout_s:g}")
                try:
                    self.on_stall(msg)
                finally:
                    print(f"paratwin: {msg}", file=sys.stderr, flush=True)
                    os._exit(3)

    def stop(self) -> None:
        self._stop.set()


class ParentWatch(threading.Thread):
    """Exits the process once its parent is no longer ``parent_pid`` (the launcher died).

    The portable half of "ranks die with their launcher" (Linux also has the parent-death
    signal): a thread, so it acts even while the main thread is blocked in a collective.
    """

    def __init__(self, parent_pid: int, period_s: float = 0.5):
        super().__init__(daemon=True, name="paratwin-parent-watch")
        self.parent_pid, self.period_s = parent_pid, period_s

    def run(self) -> None:
        while True:
            if os.getppid() != self.parent_pid:
                print(f"paratwin: the launcher (pid {self.parent_pid}) is gone; this rank exits",
                      file=sys.stderr, flush=True)
                os._exit(1)
            time.sleep(self.period_s)
