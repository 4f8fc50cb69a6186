"""The replay's walk keeps the IR's stream semantics (no processes: a fake communicator)."""

from __future__ import annotations

import threading
import time

import pytest

torch = pytest.importorskip("torch")

from executor.replay import Fault, Replayer  # noqa: E402
from twin.schedule.ir import Op, Program  # noqa: E402


class FakeWork:
    """A work handle completed by the test (with a future, like gloo's collectives)."""

    def __init__(self):
        self.future = torch.futures.Future()

    def get_future(self):
        return self.future

    def complete(self):
        self.future.set_result(None)


class FakeComm:
    """all_reduce on one rank: the first op completes when the second is issued (so it is
    still running while the host goes on), the second 30 ms after its issue."""

    def __init__(self):
        self.works: list[FakeWork] = []

    def allreduce(self, tensors):
        work = FakeWork()
        self.works.append(work)
        if len(self.works) == 2:
            self.works[0].complete()
            threading.Timer(0.03, work.complete).start()
        return work


class FakeComms:
    def __init__(self):
        self.comm = FakeComm()

    def for_op(self, op):
        return self.comm


def program() -> Program:
    g = (0, 1)
    ops = [
        Op("alloc.a", "alloc", "mem", bytes=1000, tag="a", category="activations"),    # 0
        Op("A", "gemm", "compute", shape=(16, 16, 16), dtype="fp32", flops=8192.0),    # 1
        Op("X", "all_reduce", "comm", deps=(1,), group=g, bytes=64, dtype="fp32"),    # 2
        Op("free.a", "free", "mem", deps=(2,), bytes=1000, tag="a"),                  # 3
        Op("alloc.b", "alloc", "mem", deps=(1,), bytes=500, tag="b"),                 # 4
        Op("B", "gemm", "compute", deps=(1,), shape=(16, 16, 16), dtype="fp32"),      # 5
        Op("Y", "all_reduce", "comm", deps=(2,), group=g, bytes=64, dtype="fp32"),    # 6
        Op("C", "elementwise", "compute", deps=(6,), shape=(64,), dtype="fp32",
           bytes=512.0),                                                               # 7
        Op("free.b", "free", "mem", deps=(7,), bytes=500, tag="b"),                   # 8
    ]
    return Program(0, ops)


def test_streams_deps_and_memory_follow_the_ir():
    prog = program()
    rep = Replayer(prog, FakeComms(), torch.device("cpu"), wait_timeout_s=10)
    result = rep.run_step(0)
    t = {op.name: span for op, span in zip(prog.ops, result.times)}
    # B depends only on compute: it ran while X was in flight
    assert t["B"][1] <= t["X"][1]
    # free.a waits for X (deferred, not blocking the host); its time is X's end
    assert t["free.a"][0] >= t["X"][1]
    # Y follows X on the same FIFO communicator: it starts when X ends, not at its issue
    assert t["Y"][0] >= t["X"][1]
    # C waits for Y
    assert t["C"][0] >= t["Y"][1]
    # every op has a span with start <= end
    assert len(result.times) == len(prog.ops) and all(s <= e for s, e in result.times)
    # the executor's own memory count: a (1000 B) and b (500 B) live together at the peak
    assert result.peak_bytes == 1500


def test_a_second_step_starts_from_empty_memory_and_reuses_buffers():
    rep = Replayer(program(), FakeComms(), torch.device("cpu"), wait_timeout_s=10)
    rep.run_step(0)
    rep.comms.comm.works.clear()
    held = rep.pool.held_bytes
    result = rep.run_step(1)
    assert result.peak_bytes == 1500 and rep.pool.held_bytes == held


def test_an_op_that_never_completes_is_named_after_the_wait_timeout():
    class Stuck(FakeComm):
        def allreduce(self, tensors):
            return FakeWork()

    comms = FakeComms()
    comms.comm = Stuck()
    rep = Replayer(program(), comms, torch.device("cpu"), wait_timeout_s=0.2)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"'Y' \(all_reduce on ranks \(0, 1\)\) did not complete"):
        rep.run_step(0)
    assert time.monotonic() - t0 < 5


def test_injected_crash_names_rank_step_and_op():
    rep = Replayer(program(), FakeComms(), torch.device("cpu"), fault=Fault("crash", 0, 0, 5))
    with pytest.raises(RuntimeError, match=r"injected crash at rank 0, step 0, op 5 'B'"):
        rep.run_step(0)
