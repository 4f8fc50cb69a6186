"""Compute slowed while NCCL kernels run beside it (``CostModel.overlap_slowdown``).

A collective's kernel holds some of the GPU's SMs (and HBM bandwidth) from its launch until
it completes, waiting for its peers included; compute beside it runs on the rest. (A
send/recv's kernel, one or two channels, is not counted.) With
slowdown ``s``, a compute op progresses at rate 1 / (1 + s) while at least one collective of
its rank is in flight and at rate 1 otherwise, so an op of base time ``c`` that overlaps a
call for part of its run takes ``c`` plus ``s`` times the overlapped share of its work:
started at 0 beside a call in flight over [a, b], it ends at ``c`` if c <= a, at
``a + (c - a)(1 + s)`` if it ends before the call does, else at ``b + c - a - (b - a)/(1 + s)``.

The compute stream's process advances runs of ops by arithmetic (twin/sim/engine.py); a
call that starts or ends meanwhile changes the rate for the rest of the run, so each run is
held by a ``ComputeClock``: its ops' times are written as the rate is known so far, and a
change of rate re-times the ops that end after it and moves the process's wake-up (one
event per change, none per op). Ranks on shared CPU cores (``core_share``) time each op through
the fabric's core resources instead: there an op that starts beside a call takes 1 + s times
as long (calibrated CPU profiles set s = 0: the shared cores already slow compute beside
gloo's copies, twin.calibrate.profile)."""

from __future__ import annotations

from bisect import bisect_right


def advance(t: float, work: float, times: list[float], factors: list[float]) -> float:
    """When ``work`` seconds of compute started at ``t`` end, under the time factor
    ``factors[j]`` from ``times[j]`` on (the last one for ever)."""
    j = bisect_right(times, t) - 1
    last = len(times) - 1
    while j < last:
        room = (times[j + 1] - t) / factors[j]  # work the piece [t, next change) holds
        if work <= room:
            break
        work -= room
        j += 1
        t = times[j]
    return t + work * factors[j]


def overlapped_end(start: float, c: float, a: float, b: float, s: float) -> float:
    """When ``c`` seconds of compute from ``start`` end beside one call in flight over
    [a, b] (the module docstring's closed form, by ``advance``; the search's estimate walks
    with it)."""
    return advance(start, c, [start, max(a, start), max(b, start)], [1.0, 1.0 + s, 1.0])


class ComputeClock:
    """One compute stream's run of ops in flight under ``overlap_slowdown`` (the module
    docstring): ``add`` times an op, ``hold`` is the event of the run's end, ``comm`` counts
    the rank's collectives in flight (every clock of the rank hears it)."""

    __slots__ = ("env", "factor", "start", "end", "busy", "times", "factors", "ops", "ready",
                 "work", "waiter", "floor", "generation", "events", "slowed")

    def __init__(self, env, slowdown: float, start: list, end: list):
        self.env, self.factor = env, 1.0 + slowdown
        self.start, self.end = start, end  # the rank's op times (lists while it runs)
        self.busy = 0  # collectives of the rank in flight
        self.times: list[float] = []  # the run's rate changes: from times[j], factors[j]
        self.factors: list[float] = []
        self.ops: list[int] = []  # the run's ops, their ready times and work
        self.ready: list[float] = []
        self.work: list[float] = []
        self.waiter = None  # the process's wake-up while it holds the run
        self.floor = 0.0
        self.generation = 0
        self.events = 0  # wake-ups moved by a change of rate
        self.slowed: dict[int, float] = {}
        """Op -> seconds it took past its work (beside calls): the critical path's part."""

    def add(self, i: int, ready: float, work: float) -> float:
        """Time op ``i`` after the run's ops, not before ``ready``; returns its end (as the
        rate is known so far: a change re-times it)."""
        now = self.env.now
        if not self.running():  # a new run: its ops' times so far are final
            self.ops, self.ready, self.work = [], [], []
            self.times, self.factors = [now], [self.factor if self.busy else 1.0]
            t = now
        else:
            t = self.end[self.ops[-1]]
        if ready > t:
            t = ready
        e = advance(t, work, self.times, self.factors)
        self.start[i], self.end[i] = t, e
        self.ops.append(i)
        self.ready.append(ready if ready > now else now)
        self.work.append(work)
        return e

    def running(self) -> bool:
        """Whether an op of the run ends after now."""
        return bool(self.ops) and self.end[self.ops[-1]] > self.env.now

    def hold(self, floor: float = 0.0):
        """The event the process waits for: the run's last op has ended, and ``floor``
        has passed (an op's own readiness after the run)."""
        self.waiter = self.env.event()
        self.floor = floor
        self._arm()
        return self.waiter

    def _arm(self) -> None:
        self.generation += 1
        g = self.generation
        wait = max(self.end[self.ops[-1]], self.floor) - self.env.now
        self.env.timeout(wait if wait > 0 else 0.0).callbacks.append(lambda _e: self._wake(g))

    def _wake(self, g: int) -> None:
        if g == self.generation and self.waiter is not None:  # (else: a change moved it)
            waiter, self.waiter = self.waiter, None
            start, end, slowed = self.start, self.end, self.slowed
            for i, w in zip(self.ops, self.work):
                extra = end[i] - start[i] - w
                if extra > 1e-12 * w:
                    slowed[i] = extra
            waiter.succeed()

    def comm(self, delta: int) -> None:
        """A collective of the rank starts (+1) or ends (-1) now."""
        before = self.busy
        self.busy += delta
        if bool(before) == bool(self.busy) or not self.running():
            return  # same rate, or no op of the run left to time
        now = self.env.now
        self.times.append(now)
        self.factors.append(self.factor if self.busy else 1.0)
        end, start, ops = self.end, self.start, self.ops
        k = len(ops) - 1
        while k > 0 and end[ops[k - 1]] > now:
            k -= 1  # ops[k]: the first that ends after the change; its start stays
        t = start[ops[k]]
        for j in range(k, len(ops)):
            if j > k:
                t = end[ops[j - 1]]
                if self.ready[j] > t:
                    t = self.ready[j]
            start[ops[j]] = t
            end[ops[j]] = advance(t, self.work[j], self.times, self.factors)
        if self.waiter is not None:
            self.events += 1
            self._arm()
