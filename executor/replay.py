"""Replay one rank's program for one step under the IR's stream semantics, timing every op.

The host walks the program in order (program order is the issue order of every stream):

- a compute op first waits for its communication deps, then runs its kernel;
- a collective or p2p op waits for the deps the stream order does not already imply, then
  is issued asynchronously (``async_op``): collectives on their (stream, group)
  communicator, whose single lane keeps the stream FIFO (groups.py); send/recv at once;
  a collective whose stream's previous op ran on another communicator waits for it first;
- an alloc/free applies as soon as its deps are done (deferred until then, never blocking).

Timing on CPU (``perf_counter_ns``, CLOCK_MONOTONIC): a compute op is timed around its
kernel. A collective starts at max(its issue, the end of the previous op of its
communicator) and ends when its work's future completes: a callback in gloo's worker
thread reads the clock there, late only by the wait for the GIL (at most Python's switch
interval, set to 1 ms here, and usually far less since kernels release the GIL). A
send/recv has no future on gloo: a waiter thread blocks on it and reads the clock when it
returns (the same bound). On GPU (``CudaReplayer``) every mark is a CUDA event on the
op's stream, read after the step's final synchronize: exact to the event resolution
(about 0.5 us); a collective's end event follows ``work.wait()`` on its side stream.
"""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from executor import collectives
from executor.collectives import BufferPool, Issued
from executor.groups import Comms, Key
from executor.kernels import Kernels
from executor.memory import MemoryPool
from executor.progress import Reporter
from twin.schedule.ir import Op, Program

SWITCH_INTERVAL_S = 0.001


class ReplayError(RuntimeError):
    """An op that failed or did not complete in time, named with its rank, step and group."""


@dataclass(frozen=True)
class Fault:
    """A fault to inject (tests, drills): ``kind`` crash|hang on ``rank`` at ``step``, ``op``."""

    kind: str
    rank: int
    step: int = 0
    op: int = 0


class OpTimes(NamedTuple):
    """When one op ran, in ns from the step's origin (a tuple: it pickles and saves as a pair)."""

    start_ns: int
    end_ns: int


@dataclass
class StepTimes:
    """One rank's step: per op its times from the step's origin, and memory."""

    times: list[OpTimes]
    peak_bytes: int
    """The peak of the executor's count of live alloc/free buffers."""
    issued_ns: int = 0
    """When the host had issued the step's last op, from the origin: on a GPU, before it
    waits for the device, so a step about this long was bound by the host's issue."""
    host_ns_by_kind: dict[str, int] = field(default_factory=dict)
    """Per op kind, the host's time from reaching each op to reaching the next (the last: to
    ``issued_ns``), summed over the step: on a GPU, what issuing an op of that kind costs."""


def describe(op: Op) -> str:
    where = f" on ranks {op.group}" if op.group else (f" with rank {op.peer}" if op.is_p2p else "")
    return f"{op.name!r} ({op.kind}{where})"


class Replayer:
    """Runs ``program`` step after step on ``comms`` (CPU; see CudaReplayer for GPU)."""

    def __init__(self, program: Program, comms: Comms, device: torch.device, *,
                 verify: bool = False,
                 wait_timeout_s: float = 600.0, reporter: Reporter | None = None,
                 fault: Fault | None = None):
        self.ops, self.rank = program.ops, program.rank
        self.comms, self.device, self.verify = comms, device, verify
        self.wait_timeout_s = wait_timeout_s
        self.reporter, self.fault = reporter, fault
        self.kernels = Kernels(device)
        self.memory = MemoryPool(device)
        self.pool = BufferPool(device)
        self.is_async = [op.is_collective or op.is_p2p for op in self.ops]
        self.key: list[Key | None] = [(op.stream, tuple(op.group)) if op.is_collective else None
                                      for op in self.ops]
        # the previous op on the same communicator: its end bounds this op's start (FIFO)
        self.prev_same_key: list[int | None] = []
        last: dict[Key, int] = {}
        for i, k in enumerate(self.key):
            self.prev_same_key.append(last.get(k) if k else None)
            if k:
                last[k] = i
        sys.setswitchinterval(SWITCH_INTERVAL_S)

    # -- the walk ------------------------------------------------------------------------
    def run_step(self, step: int) -> StepTimes:
        """Run every op once; returns times relative to the step's origin (its first clock read)."""
        n = len(self.ops)
        self._step = step
        self._start: list[int] = [0] * n
        self._end: list[int | None] = [None] * n
        self._issue: list[int] = [0] * n
        self._issued: dict[int, Issued] = {}
        self._done: dict[int, threading.Event] = {}
        self._error: dict[int, BaseException] = {}
        self._mem_pending: list[int] = []
        last_on_stream: dict[str, int] = {}
        self.memory.reset()
        self._begin()
        reached = [0] * n  # perf_counter_ns when the host reached each op
        for i, op in enumerate(self.ops):
            reached[i] = time.perf_counter_ns()
            self._report(i)
            if self.fault and self.fault.rank == self.rank and (self.fault.step, self.fault.op) \
                    == (step, i):
                self._inject(op, i)
            if self._mem_pending:
                self._drain_memory()
            self._retire_completed()
            if op.is_compute:
                for d in op.deps:
                    if self.is_async[d]:
                        self._wait(d, i)
                self._compute(i, op)
            elif self.is_async[i]:
                for d in op.deps:
                    if self.is_async[d] and not (op.is_collective and self.key[d] == self.key[i]):
                        self._wait(d, i)
                if op.is_collective:
                    prev = last_on_stream.get(op.stream)
                    if prev is not None and self.key[prev] != self.key[i]:
                        self._wait(prev, i)
                    last_on_stream[op.stream] = i
                self._launch(i, op)
            elif op.is_memory:
                self._reach_memory(i)
                self._mem_pending.append(i)
                self._drain_memory()
            else:
                raise ReplayError(f"rank {self.rank}: op {op.name!r} has unknown kind {op.kind!r}")
        end = time.perf_counter_ns()
        issued = end - self._origin
        by_kind: dict[str, int] = {}
        for op, a, b in zip(self.ops, reached, reached[1:] + [end]):
            by_kind[op.kind] = by_kind.get(op.kind, 0) + b - a
        self._finish()
        if self._mem_pending:
            names = [self.ops[i].name for i in self._mem_pending[:3]]
            raise ReplayError(f"rank {self.rank}: memory ops {names} never became ready")
        return StepTimes(self._resolve(), self.memory.peak_bytes, issued, by_kind)

    def _report(self, i: int, waiting: bool = False) -> None:
        if self.reporter is not None:
            self.reporter.op(i, waiting)

    def _inject(self, op: Op, i: int) -> None:
        where = f"rank {self.rank}, step {self._step}, op {i} {op.name!r}"
        if self.fault.kind == "crash":
            raise RuntimeError(f"injected crash at {where}")
        if self.fault.kind == "hang":
            while True:  # no progress reported: the watchdog must notice and kill the run
                time.sleep(1.0)
        raise ValueError(f"fault kind {self.fault.kind!r} is not crash|hang")

    def _is_done(self, d: int) -> bool:
        if self.is_async[d]:
            return self._done[d].is_set() if d in self._done else False
        if self.ops[d].is_memory:
            return self._end[d] is not None  # set when applied
        return True  # compute ops before the current one have run

    def _drain_memory(self) -> None:
        """Apply, in program order, the pending memory ops whose deps are all done."""
        keep: list[int] = []
        waiting_allocs: set[str] = set()
        for i in self._mem_pending:
            op = self.ops[i]
            name = op.tag or op.name
            if all(self._is_done(d) for d in op.deps) and name not in waiting_allocs:
                self.memory.apply(op)
                # when the host reached it, or later when its last dep completed
                t = max([self._end_of(d) for d in op.deps] + [self._start[i]])
                self._start[i] = self._end[i] = t
            else:
                keep.append(i)
                if op.kind == "alloc":
                    waiting_allocs.add(name)  # its free must not overtake it
        self._mem_pending = keep

    # -- CPU specifics (overridden on GPU) --------------------------------------------------
    def _begin(self) -> None:
        self._origin = self.origin_ns = time.perf_counter_ns()

    def _now(self) -> int:
        return time.perf_counter_ns() - self._origin

    def _reach_memory(self, i: int) -> None:
        self._start[i] = self._now()  # the host got here; it applies when its deps are done

    def _end_of(self, d: int) -> int:
        return self._end[d] if self._end[d] is not None else 0

    def _compute(self, i: int, op: Op) -> None:
        t0 = self._now()
        self.kernels.run(op)
        self._start[i], self._end[i] = t0, self._now()

    def _launch(self, i: int, op: Op) -> None:
        done = threading.Event()
        self._done[i] = done
        self._issue[i] = self._now()
        issued = collectives.issue(self.comms.for_op(op), op, self.rank, self.pool, self.verify)
        self._issued[i] = issued

        def finished(err: BaseException | None = None) -> None:
            self._end[i] = self._now()
            if err is not None:
                self._error[i] = err
            done.set()

        try:
            future = issued.work.get_future()
        except RuntimeError:  # gloo send/recv: no future; a waiter thread observes the end
            future = None
        if future is not None:
            def on_future(f) -> None:
                try:
                    f.value()
                except BaseException as err:  # noqa: BLE001 - reported by _wait
                    finished(err)
                    return
                finished()

            future.add_done_callback(on_future)
            return

        def waiter() -> None:
            try:
                issued.work.wait(_td(self.wait_timeout_s))
            except BaseException as err:  # noqa: BLE001 - reported by _wait
                finished(err)
                return
            finished()

        threading.Thread(target=waiter, daemon=True, name=f"p2p-{op.name}").start()

    def _wait(self, d: int, at: int) -> None:
        """Block the host until async op ``d`` completes (reporting the wait to the board)."""
        done = self._done.get(d)
        if done is None or done.is_set():
            self._check_error(d)
            return
        self._report(at, waiting=True)
        if not done.wait(self.wait_timeout_s):
            raise ReplayError(f"rank {self.rank}, step {self._step}: {describe(self.ops[d])} did "
                              f"not complete within {self.wait_timeout_s:g} s")
        self._report(at)
        self._check_error(d)

    def _check_error(self, d: int) -> None:
        err = self._error.get(d)
        if err is not None:
            raise ReplayError(f"rank {self.rank}, step {self._step}: {describe(self.ops[d])} "
                              f"failed: {err}") from err

    def _retire_completed(self) -> None:
        """Check the results of completed ops (verify mode) and give back their buffers."""
        for i in [i for i in self._issued if self._done[i].is_set()]:
            self._check_error(i)
            issued = self._issued.pop(i)
            if self.verify:
                collectives.check(self.ops[i], self.rank, issued)
            self.pool.give(*issued.buffers)

    def _finish(self) -> None:
        """Wait for every op still in flight, then apply the last memory ops."""
        for i in list(self._issued):
            self._wait(i, len(self.ops) - 1)
        self._drain_memory()
        self._retire_completed()

    def _resolve(self) -> list[OpTimes]:
        out = []
        for i in range(len(self.ops)):
            end = self._end[i] if self._end[i] is not None else self._start[i]
            start = self._start[i]
            if self.is_async[i]:
                start = self._issue[i]
                prev = self.prev_same_key[i]
                if prev is not None and self._end[prev] is not None:
                    start = max(start, self._end[prev])
                start = min(start, end)
            out.append(OpTimes(start, end))
        return out


def _td(seconds: float):
    import datetime

    return datetime.timedelta(seconds=seconds)
