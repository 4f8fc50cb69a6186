"""Private collectives: calls whose links no other stream's calls cross, timed by arithmetic.

A collective with one simulated member (its copies folded) starts when that member reaches
it. When every fabric resource its bundles cross is crossed by the calls of no other (rank,
stream), no other flow is ever on them while it runs (a stream runs one op at a time), so
the fabric gives each phase its uncontended rate: the call lasts, from its start, the base
latency, then per phase its latency and its bundle's bytes / min over the bundle's resources
of capacity / (weight * cost) (twin/sim/fabric.py's rate law under its own load alone).

A stream of such calls (a TP stream: each all-reduce waits for the compute op just before
it, the compute after it waits for the all-reduce) is walked by the compute stream's
process (``inline_walk``): its ops are timed as the compute ops are, with no events, and
only those another process waits for (the host's sync points) get one. The engine's times
are the same as with each call run through the fabric (tests/sim/test_private_calls.py).
"""

from __future__ import annotations

import math
from bisect import bisect_left
from typing import NamedTuple

from twin.schedule.ir import Op

COMPUTE = "compute"
"""The stream whose process walks the inlined streams."""


class PrivateCall(NamedTuple):
    """One planned call whose resources only its caller's stream uses."""

    caller: tuple[int, str]
    """(rank, stream) of its only caller."""
    base_s: float
    phases: tuple[tuple[float, float, float], ...]
    """Per phase: (latency, bytes per op byte, rate alone in bytes/s; 0: no transfer)."""

    def duration_s(self, nbytes: float) -> float:
        """From its start to its end, as Simulation._next_phase and the fabric time it."""
        t = 0.0
        for k, (lat, per_byte, rate) in enumerate(self.phases):
            lat = lat + self.base_s if k == 0 else lat
            if lat > 0:
                t += lat
            amount = per_byte * nbytes
            if rate and amount > 0:
                t += amount / rate
        return t


def private_calls(planner, capacity: dict, simulated: set[int]) -> dict[tuple, PrivateCall]:
    """Memo key -> PrivateCall of each collective of a prepared FlowPlanner that has one
    simulated member, one caller (rank, stream), and resources no other caller uses."""
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
        phases = []
        for b, lat in zip(plan.bundles, plan.latencies_s):
            if b is None or not b.resources:
                phases.append((lat, 0.0, 0.0))
                continue
            if any(users[r] != who for r in b.resources):
                break
            rate = min(capacity[r] / (w * c) for r, w, c in zip(b.resources, b.weights,
                                                                 b.byte_costs))
            phases.append((lat, b.size_bytes, rate if rate > 0 else math.inf))
        else:
            out[key] = PrivateCall(next(iter(who)), plan.base_latency_s, tuple(phases))
    return out


def call_key(op: Op) -> tuple:
    """The FlowPlanner memo key of a collective op."""
    return ("c", op.kind, op.group, op.root, op.group_name)


class Walk(NamedTuple):
    """What a rank's processes walk when some streams are inlined into the compute one."""

    walks: dict[str, list[int]]
    """Process (a stream) -> its ops in program order (inlined streams' ops included)."""
    external: set[int]
    """Ops another process (or the host's sync) waits for: they get events."""
    ext_deps: list[tuple[int, ...]]
    """Per op: its dependencies another process times (waited for by event)."""
    cross: list[tuple[int, ...]]
    """Per op: its dependencies on another stream of its own walk (timed by arithmetic)."""


def inline_streams(rank: int, ops: list[Op], streams: dict[str, list[int]],
                   private: dict[tuple, PrivateCall]) -> tuple[str, ...]:
    """The streams of ``rank`` the compute walk can time: every op a private call of this
    (rank, stream) whose dependencies lie on the compute stream or its own, among them the
    compute op just before it (so it never starts before the walk's clock)."""
    comp = streams.get(COMPUTE)
    if not comp:
        return ()
    out = []
    for s, idx in streams.items():
        if s in (COMPUTE, "p2p", "mem"):
            continue
        for i in idx:
            op = ops[i]
            if not op.is_collective or op.send_splits:
                break
            call = private.get(call_key(op))
            if call is None or call.caller != (rank, s):
                break
            if any(ops[d].stream not in (COMPUTE, s) for d in op.deps):
                break
            k = bisect_left(comp, i)
            if k and comp[k - 1] not in op.deps:
                break
        else:
            out.append(s)
    return tuple(out)


def inline_walk(ops: list[Op], streams: dict[str, list[int]], inlined: tuple[str, ...],
                host) -> Walk:
    """The Walk of a program whose ``inlined`` streams the compute stream's process times."""
    walks = {s: list(idx) for s, idx in streams.items() if s not in inlined}
    walks[COMPUTE] = sorted(i for s in (COMPUTE, *inlined) for i in streams[s])
    walk_of = {}
    for s, idx in walks.items():
        for i in idx:
            walk_of[i] = -1 - i if s == "p2p" else s  # each p2p op is its own process
    external: set[int] = set()
    for i, op in enumerate(ops):
        if op.stream == "mem":
            continue
        for d in op.deps:
            if walk_of.get(d) != walk_of[i]:
                external.add(d)
    if host is not None:
        for waited in host.waits.values():
            external.update(waited)
    ext_deps, cross = [], []
    for i, op in enumerate(ops):
        w = walk_of.get(i)
        ext_deps.append(tuple(d for d in op.deps if d in external and walk_of.get(d) != w))
        cross.append(tuple(d for d in op.deps if walk_of.get(d) == w
                           and ops[d].stream != op.stream) if w is not None else ())
    return Walk(walks, external, ext_deps, cross)
