"""The replay on GPU: compute on the default stream, communicators fed from side streams, CUDA events.

The host never blocks inside a step: dependencies become ``wait_event`` between streams.
A collective or p2p op is issued from the side stream of its (stream, group) key (one per
key, so each keeps the IR's FIFO order; ProcessGroupNCCL's internal stream waits for the
side stream at issue), after that side stream waited for the end events of the op's
deps; ``work.wait()`` then makes the side stream wait for the NCCL kernel, and the end
event recorded after it marks the op's end. A compute op's stream waits for the end
events of its communication deps. Memory ops apply when the host reaches them (the
caching allocator orders reuse by stream) and are stamped no earlier than their deps.
Times are ``origin.elapsed_time(event)`` after the step's final synchronize: exact to the
event resolution (about 0.5 us). Not exercised by CI (no GPU); benchmarks/gpu_calibration.py
runs it.
"""

from __future__ import annotations

import time

import torch

from executor import collectives
from executor.replay import Replayer, ReplayError, describe
from twin.schedule.ir import Op


class CudaReplayer(Replayer):
    """Replayer for CUDA devices and NCCL communicators."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._side: dict[object, torch.cuda.Stream] = {}

    def _event(self, stream=None) -> torch.cuda.Event:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(stream)
        return ev

    def _begin(self) -> None:
        torch.cuda.synchronize(self.device)
        self.origin_ns = time.perf_counter_ns()
        self._ev_start: dict[int, torch.cuda.Event] = {}
        self._ev_end: dict[int, torch.cuda.Event] = {}
        self._origin_ev = self._event()

    def _side_stream(self, i: int, op: Op) -> torch.cuda.Stream:
        key = self.key[i] or ("p2p", op.kind, op.peer)
        if key not in self._side:
            self._side[key] = torch.cuda.Stream(device=self.device)
        return self._side[key]

    def _compute(self, i: int, op: Op) -> None:
        self._ev_start[i] = self._event()
        self.kernels.run(op)
        self._ev_end[i] = self._event()

    def _launch(self, i: int, op: Op) -> None:
        side = self._side_stream(i, op)
        for d in op.deps:
            if d in self._ev_end:
                side.wait_event(self._ev_end[d])
        with torch.cuda.stream(side):
            self._ev_start[i] = self._event(side)
            issued = collectives.issue(self.comms.for_op(op), op, self.rank, self.pool, self.verify)
            issued.work.wait()  # the side stream waits for the NCCL kernel; the host does not
            self._ev_end[i] = self._event(side)
        self._issued[i] = issued

    def _wait(self, d: int, at: int) -> None:
        if self.is_async[at]:
            return  # _launch orders the op after its deps with events
        ev = self._ev_end.get(d)
        if ev is not None:
            torch.cuda.current_stream(self.device).wait_event(ev)

    def _is_done(self, d: int) -> bool:
        return True  # the GPU orders everything with events; the host never waits

    def _drain_memory(self) -> None:
        for i in self._mem_pending:
            self.memory.apply(self.ops[i])
            self._ev_start[i] = self._ev_end[i] = self._event()
            self._end[i] = 0
        self._mem_pending = []

    def _retire_completed(self) -> None:
        for i in [i for i in self._issued if self._ev_end[i].query()]:
            issued = self._issued.pop(i)
            if self.verify:
                collectives.check(self.ops[i], self.rank, issued)
            self.pool.give(*issued.buffers)

    def _finish(self) -> None:
        self._drain_memory()
        try:
            torch.cuda.synchronize(self.device)
        except RuntimeError as err:
            raise ReplayError(f"rank {self.rank}, step {self._step}: the GPU failed: {err}") from err
        self._retire_completed()
        if self._issued:
            i = next(iter(self._issued))
            raise ReplayError(f"rank {self.rank}: {describe(self.ops[i])} never completed")

    def _resolve(self) -> list[tuple[int, int]]:
        def ns(ev: torch.cuda.Event) -> int:
            return int(self._origin_ev.elapsed_time(ev) * 1e6)

        out = []
        for i, op in enumerate(self.ops):
            start, end = ns(self._ev_start[i]), ns(self._ev_end[i])
            if op.is_memory:  # no earlier than its deps
                start = end = max([start] + [ns(self._ev_end[d]) for d in op.deps])
            out.append((start, max(start, end)))
        return out
