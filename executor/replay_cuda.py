"""The replay on GPU: compute on the default stream, communicators fed from side streams, CUDA events.

The host never blocks inside a step: dependencies become ``wait_event`` between streams.
A collective or p2p op is issued from the side stream of its (stream, group) key (one per
key, so each keeps the IR's FIFO order; ProcessGroupNCCL's internal stream waits for the
side stream at issue), after that side stream waited for the end events of the op's
deps; ``work.wait()`` then makes the side stream wait for the NCCL kernel, and the end
event recorded after it marks the op's end. A compute op's stream waits for the end
events of its communication deps. Memory ops apply when the host sees their deps
finished on the GPU (event queries at op boundaries) and are stamped at the later of
where the host reached them and their deps' ends. Times are
``origin.elapsed_time(event)`` after the step's final synchronize: exact to the event
resolution (about 0.5 us). Not exercised by CI (no GPU); benchmarks/gpu_calibration.py
runs it.
"""

from __future__ import annotations

import time

import torch

from executor import collectives
from executor.replay import OpTimes, Replayer, ReplayError, describe
from twin.schedule.ir import Op


class CudaReplayer(Replayer):
    """Replayer for CUDA devices and NCCL communicators."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # one side stream per communicator key, or per ("p2p", kind, peer) direction
        self._side: dict[tuple, torch.cuda.Stream] = {}
        # each op's start and end events, made once and recorded again every step (a step's
        # times are read after its final synchronize): a new CUDA event per record would add
        # its creation to the host's time per op, which a training step does not pay
        self._pooled: list[tuple[torch.cuda.Event, torch.cuda.Event]] | None = None

    def _event(self, i: int, end: bool, stream=None) -> torch.cuda.Event:
        """Op ``i``'s start (or end) event, recorded now on ``stream`` (default: the current)."""
        ev = self._pooled[i][end]
        # named: Event.record(None) looks the current stream up on every call
        ev.record(self._stream if stream is None else stream)
        return ev

    def _begin(self) -> None:
        torch.cuda.synchronize(self.device)
        self._stream = torch.cuda.current_stream(self.device)
        if self._pooled is None:
            self._pooled = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                            for _ in range(len(self.ops) + 1)]
        self._origin = self.origin_ns = time.perf_counter_ns()
        self._ev_start: dict[int, torch.cuda.Event] = {}
        self._ev_end: dict[int, torch.cuda.Event] = {}
        self._origin_ev = self._event(len(self.ops), False)

    def _side_stream(self, i: int, op: Op) -> torch.cuda.Stream:
        key = self.key[i] or ("p2p", op.kind, op.peer)
        if key not in self._side:
            self._side[key] = torch.cuda.Stream(device=self.device)
        return self._side[key]

    def _compute(self, i: int, op: Op) -> None:
        self._ev_start[i] = self._event(i, False)
        self.kernels.run(op)
        self._ev_end[i] = self._event(i, True)

    def _launch(self, i: int, op: Op) -> None:
        side = self._side_stream(i, op)
        for d in op.deps:
            if d in self._ev_end:
                side.wait_event(self._ev_end[d])
        with torch.cuda.stream(side):
            self._ev_start[i] = self._event(i, False, side)
            issued = collectives.issue(self.comms.for_op(op), op, self.rank, self.pool, self.verify)
            issued.work.wait()  # the side stream waits for the NCCL kernel; the host does not
            self._ev_end[i] = self._event(i, True, side)
        self._issued[i] = issued

    def _wait(self, d: int, at: int) -> None:
        """The stream of op ``at`` (its side stream, or the compute stream) waits for ``d``."""
        ev = self._ev_end.get(d)
        if ev is None:
            return
        if self.is_async[at]:
            self._side_stream(at, self.ops[at]).wait_event(ev)
        else:
            self._stream.wait_event(ev)

    def _reach_memory(self, i: int) -> None:
        self._ev_start[i] = self._event(i, False)

    def _is_done(self, d: int) -> bool:
        if self.ops[d].is_memory:
            return self._end[d] is not None
        ev = self._ev_end.get(d)
        return ev is not None and ev.query()

    def _drain_memory(self) -> None:
        """Apply pending memory ops once the host sees their deps finished on the GPU (event
        queries at op boundaries; so a free after a collective keeps its buffer until the
        collective is done). The host only polls, so on GPU the moment a buffer is taken or
        dropped, and with it max_memory_allocated, is approximate."""
        keep: list[int] = []
        waiting_allocs: set[str] = set()
        for i in self._mem_pending:
            op = self.ops[i]
            name = op.tag or op.name
            if name in waiting_allocs or not all(self._is_done(d) for d in op.deps):
                keep.append(i)
                if op.kind == "alloc":
                    waiting_allocs.add(name)
                continue
            self.memory.apply(op)
            self._ev_end[i] = self._ev_start[i]
            self._end[i] = 0
        self._mem_pending = keep

    def _retire_completed(self) -> None:
        for i in [i for i in self._issued if self._ev_end[i].query()]:
            issued = self._issued.pop(i)
            if self.verify:
                collectives.check(self.ops[i], self.rank, issued)
            self.pool.give(*issued.buffers)

    def _finish(self) -> None:
        try:
            torch.cuda.synchronize(self.device)
        except RuntimeError as err:
            raise ReplayError(f"rank {self.rank}, step {self._step}: the GPU failed: {err}") from err
        self._drain_memory()
        self._retire_completed()
        if self._issued:
            i = next(iter(self._issued))
            raise ReplayError(f"rank {self.rank}: {describe(self.ops[i])} never completed")

    def _resolve(self) -> list[OpTimes]:
        def ns(ev: torch.cuda.Event) -> int:
            return int(self._origin_ev.elapsed_time(ev) * 1e6)

        out = []
        for i, op in enumerate(self.ops):
            start, end = ns(self._ev_start[i]), ns(self._ev_end[i])
            if op.is_memory:  # no earlier than its deps
                start = end = max([start] + [ns(self._ev_end[d]) for d in op.deps])
            out.append(OpTimes(start, max(start, end)))
        return out
