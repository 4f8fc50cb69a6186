"""Private collectives: calls whose links no other stream's flows meet, timed by arithmetic.

A collective with one simulated member (its copies folded) starts when that member reaches
it. While no other flow is on the fabric resources its bundles cross, the fabric gives each
phase its uncontended rate: the call lasts the base latency, then per phase its latency and
its bundle's bytes / min over the bundle's resources of capacity / (weight * cost)
(twin/sim/fabric.py's rate law under its own load alone). Its resources that only its own
stream's calls cross are free whenever it runs (a stream runs one op at a time); those that
other calls cross too (``shared``: a TP group's NVSwitch ports and the clipping norm's
all-reduce at step end) are held while it runs, and a flow that starts on one meanwhile,
or was on it, raises Contended: the engine then simulates the step again with every call in
the fabric (Simulation.run), so the result never depends on the guess.

A stream of such calls (a TP stream: each all-reduce waits for the compute op just before
it, the compute after it waits for the all-reduce) is walked by the compute stream's
process (twin/sim/walks.py): its ops are timed as the compute ops are, with no events, and
only those another process waits for (the host's sync points) get one. The engine's times
are the ones the fabric gives (tests/sim/test_private_calls.py): ``finish`` repeats the float
operations of its timeouts.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from typing import NamedTuple

from twin.schedule.ir import Op
from twin.sim.fabric import EPS, Contended
from twin.sim.flows import call_key
from twin.vocab import COLLECTIVE_KINDS

COMPUTE = "compute"
"""The stream whose process walks the inlined streams."""


class PrivateCall(NamedTuple):
    """One planned call whose resources only its caller's stream uses."""

    caller: tuple[int, str]
    """(rank, stream) of its only caller."""
    base_s: float
    phases: tuple[tuple[float, float, float], ...]
    """Per phase: (latency, bytes per op byte, rate alone in bytes/s; 0: no transfer)."""
    shared: tuple = ()
    """Its resources that other calls cross too (at other times, or the engine finds the
    overlap and simulates again with every call in the fabric: Simulation.run)."""

    def steps(self, nbytes: float) -> tuple[tuple[float, float], ...]:
        """Per phase: (latency, seconds of its transfer alone; -1: none), for ``nbytes``."""
        out = []
        for k, (lat, per_byte, rate) in enumerate(self.phases):
            amount = per_byte * nbytes
            out.append((lat + self.base_s if k == 0 else lat,
                        amount / rate if rate and amount > 0 else -1.0))
        return tuple(out)

    def end_s(self, start: float, nbytes: float) -> float:
        """When it ends if it starts at ``start`` (``finish``)."""
        return finish(start, self.steps(nbytes))


def finish(t: float, steps: tuple[tuple[float, float], ...]) -> float:
    """The end of a call started at ``t``, its steps timed with the float operations the
    engine's timeouts and the fabric's completions use (Simulation._next_phase: a latency's
    timeout ends at t + lat; Fabric._arm: a flow started at t with eta = t + x ends at
    t + (eta - t)), so a private call ends at the instant its fabric run would."""
    for lat, x in steps:
        if lat > 0:
            t = t + lat
        if x >= 0:
            t = t + max(0.0, (t + x) - t)
    return t


def private_calls(planner, capacity: dict, simulated: set[int]) -> dict[tuple, PrivateCall]:
    """Memo key -> PrivateCall of each collective of a prepared FlowPlanner that has one
    simulated member and one caller (rank, stream); ``shared``: its resources other calls
    use too."""
    users: dict = {}
    memo = planner._memo
    for key, who in planner.callers.items():
        for b in memo[key].bundles:
            if b is not None:
                for r in b.resources:
                    users.setdefault(r, set()).update(who)
    out: dict[tuple, PrivateCall] = {}
    for key, who in planner.callers.items():
        if key[0] != "c" or len(who) != 1 or sum(m in simulated for m in key[2]) != 1:
            continue
        plan = memo[key]
        phases, shared = [], {}
        for b, lat in zip(plan.bundles, plan.latencies_s):
            if b is None or not b.resources:
                phases.append((lat, 0.0, 0.0))
                continue
            shared.update((r, None) for r in b.resources if users[r] != who)
            rate = b.alone_rate(capacity)
            phases.append((lat, b.size_bytes, rate if rate > 0 else math.inf))
        out[key] = PrivateCall(next(iter(who)), plan.base_latency_s, tuple(phases),
                               tuple(shared))
    return out


def inline_streams(rank: int, ops: list[Op], streams: dict[str, list[int]],
                   private: dict[tuple, PrivateCall], host=None) -> tuple[str, ...]:
    """The streams of ``rank`` the compute walk can time: every op a private call of this
    (rank, stream) whose dependencies lie on the compute stream or its own. A call the host
    waits for, or on links other calls use, must start no earlier than the walk's clock
    when the walk reaches it (its event or its check of the links happen then): one of its
    dependencies is no earlier than the compute op just before it (only compute ops move the
    clock past an op's dependencies; the walk checks it, Simulation._stream)."""
    comp = streams.get(COMPUTE)
    if not comp:
        return ()
    waited = {w for ws in host.waits.values() for w in ws} if host is not None else set()
    out = []
    get = private.get
    for s, idx in streams.items():
        if s in (COMPUTE, "p2p", "mem"):
            continue
        caller, mine = (rank, s), (COMPUTE, s)
        for i in idx:
            op = ops[i]
            if op.kind not in COLLECTIVE_KINDS or op.send_splits:
                break
            call = get(call_key(op))
            if call is None or call.caller != caller:
                break
            deps = op.deps
            if len(deps) == 1:  # (most calls: the op that made their buffer)
                if ops[deps[0]].stream not in mine:
                    break
            elif any(ops[d].stream not in mine for d in deps):
                break
            if call.shared or i in waited:  # a dependency no earlier than the compute op before
                k = bisect_left(comp, i)
                if k and (max(deps) if deps else -1) < comp[k - 1]:
                    break
        else:
            out.append(s)
    return tuple(out)


class Inliner:
    """The private calls of one simulation, their durations per op, and the resources they
    hold that other calls use too (a flow there meanwhile raises Contended)."""

    def __init__(self, fabric, calls: dict[tuple, PrivateCall]):
        self.fabric, self.calls = fabric, calls
        self._times: dict[tuple, tuple] = {}  # (stream, call key, bytes) -> timed's value
        self._owners: dict = {}  # shared resource -> the (rank, stream) whose call holds it

    @classmethod
    def of(cls, planner, fabric, simulated: set[int], on: bool = True) -> Inliner:
        """The private calls of a prepared FlowPlanner (none unless ``on``: the engine turns
        them off where noise, compute slowed by communication, shared cores or a degraded
        link, whose idle warning reads the fabric, need every call in the fabric)."""
        return cls(fabric, private_calls(planner, fabric.capacity, simulated) if on else {})

    def streams(self, rank: int, ops: list[Op], streams: dict[str, list[int]],
                host=None) -> tuple:
        """The streams of ``rank`` its compute walk times (inline_streams)."""
        return inline_streams(rank, ops, streams, self.calls, host) if self.calls else ()

    def timed(self, ops: list[Op], streams: dict[str, list[int]],
              inlined: tuple[str, ...]) -> dict[int, tuple]:
        """Op -> (steps, shared resources, stream) of each op of the ``inlined`` streams."""
        out = {}
        times = self._times
        for s in inlined:
            for i in streams[s]:
                op = ops[i]
                key = (s, call_key(op), op.bytes)
                t = times.get(key)
                if t is None:
                    call = self.calls[key[1]]
                    t = times[key] = (call.steps(op.bytes), call.shared, s)
                out[i] = t
        return out

    def reserve(self, shared: tuple, start: float, end: float, owner: tuple) -> None:
        """A call on links other calls use too, from ``start`` to ``end``: no flow may be on
        them, nor another stream's call, meanwhile."""
        fabric = self.fabric
        for r in shared:
            if fabric.flows_on.get(r) or self._owners.get(r, owner) != owner \
                    and fabric.reserved[r] > start * (1 + EPS):
                raise Contended(r)
            fabric.reserved[r] = end
            self._owners[r] = owner
