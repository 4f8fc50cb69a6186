"""The progress board: slots a watchdog in another process can read."""

from __future__ import annotations

import os
import time

from executor.progress import Board, Reporter


def test_slots_round_trip_through_the_file(tmp_path):
    path = tmp_path / "progress.bin"
    board = Board(3, path, create=True)
    rep = Reporter(board, 2)
    rep.set_phase("measure", 4)
    rep.op(17, waiting=True)
    other = Board(3, path)  # as the launcher opens it
    slot = other.read(2)
    assert (slot.phase, slot.step, slot.op, slot.waiting, slot.pid) == ("measure", 4, 17, True,
                                                                         os.getpid())
    assert abs(time.monotonic_ns() - slot.t_ns) < 60e9
    assert other.read(0).t_ns == 0  # a rank that never reported
    board.close()
    other.close()
