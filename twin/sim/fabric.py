"""Fabric: links and shared cores as processor-sharing resources for fluid flows.

A flow moves ``amount`` units (bytes, or core-seconds for compute on shared cores)
across one or more resources. Its rate is min(cap, min over its resources of
capacity / (load * cost)), where load is the summed weight of the flows on the resource
and cost the units of the resource one unit of the flow uses: two
equal flows on one link each get half of it and take twice as long (the twin's
contention test). A flow of weight k on a resource stands for k identical flows there
(rank folding).

Only flows that share a resource with a starting or finishing flow are re-rated, and
completions come from a heap with lazy invalidation, so a quiet fabric costs nothing.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import simpy

from twin.sim.topology import Resource

EPS = 1e-12


@dataclass(slots=True, eq=False)
class Flow:
    """One flow in flight: what it has left to move and the rate it moves at since ``t_s``."""

    id: int
    """Creation order: breaks ties between flows due at the same time."""
    amount: float
    """Units to move (bytes, or core-seconds on shared cores)."""
    remaining: float
    """Units left at ``t_s``."""
    resources: tuple[Resource, ...]
    cap: float
    """The flow's own rate limit, units per second (inf: none)."""
    weights: tuple[float, ...]
    """Per resource: how many identical flows this one stands for there."""
    costs: tuple[float, ...]
    """Per resource: units of the resource one unit of the flow uses."""
    event: simpy.Event | Callable[[], None]
    """Fires when the flow has moved ``amount`` (a callable: called then, Fabric.transfer)."""
    t_s: float
    """Simulated time of the last re-rate."""
    rate: float = 0.0
    """Units per second since ``t_s``."""
    version: int = 0
    """Bumped at each re-rate and at completion: heap entries of older versions are stale."""


class Due(NamedTuple):
    """A heap entry: ``flow`` finishes at ``eta_s`` unless re-rated since (``version`` stale)."""

    eta_s: float
    flow_id: int
    version: int
    flow: Flow


class Contended(Exception):
    """A flow met a call the engine timed as alone on its links (twin/sim/private.py)."""


class Fabric:
    """All shared resources of the simulated machine and the flows crossing them."""

    def __init__(self, env: simpy.Environment, capacity: dict[Resource, float]):
        self.env = env
        self.capacity = capacity  # resource -> units per second
        self.load: dict[Resource, float] = {}  # resource -> summed weight of its flows
        self.flows_on: dict[Resource, set[Flow]] = {}
        self.heap: list[Due] = []
        self._ids = itertools.count()
        self._armed = math.inf
        self._token = 0
        self.flows_done = 0
        self.reserved: dict[Resource, float] = {}
        """Resource -> when the calls timed off the fabric on it end (twin/sim/private.py):
        a flow that starts on it before then raises Contended."""

    def transfer(self, resources: tuple[Resource, ...], amount: float, cap: float = math.inf,
                 weights: tuple[float, ...] | None = None,
                 costs: tuple[float, ...] | None = None,
                 then: Callable[[], None] | None = None) -> simpy.Event | bool:
        """Start a flow now; the returned event fires when it has moved ``amount``. With
        ``then``: no event; ``then()`` is called when the flow has moved ``amount``, right
        after the fabric has re-rated the flows left (not a step of the event loop later), and
        the return says whether a flow started (False: nothing to move, ``then`` not called).

        ``weights`` (one per resource, default 1): how many identical flows this one
        stands for on each resource (folded ranks sharing a NIC or the cores). ``costs`` (one
        per resource, default 1): units of the resource one unit of ``amount`` uses (a byte
        copied by gloo costs 1/B core-seconds of the host's cores)."""
        if amount <= 0 or not resources:
            if then is not None:
                return False
            ev = self.env.event()
            ev.succeed()
            return ev
        ev = self.env.event() if then is None else then
        for r in resources:
            if r not in self.capacity:
                raise KeyError(f"unknown fabric resource {r!r}")
            if self.reserved and self.reserved.get(r, -math.inf) > self.env.now * (1 + EPS):
                raise Contended(r)
        weights = weights or (1.0,) * len(resources)
        costs = costs or (1.0,) * len(resources)
        f = Flow(next(self._ids), amount, amount, resources, cap, weights, costs, ev, self.env.now)
        affected = set()
        for r, w in zip(resources, weights):
            self.load[r] = self.load.get(r, 0.0) + w
            on = self.flows_on.setdefault(r, set())
            affected |= on
            on.add(f)
        affected.add(f)
        self._rerate(affected)
        return ev if then is None else True

    def _rate(self, f: Flow) -> float:
        rate = f.cap
        for r, k in zip(f.resources, f.costs):  # each of the w copies on r gets capacity / load
            rate = min(rate, self.capacity[r] / (self.load[r] * k))
        return rate

    def _rerate(self, flows) -> None:
        now = self.env.now
        for f in flows:
            f.remaining -= f.rate * (now - f.t_s)
            f.t_s = now
            f.rate = self._rate(f)
            f.version += 1
            eta = now + (f.remaining / f.rate if f.rate > 0 else math.inf)
            heapq.heappush(self.heap, Due(eta, f.id, f.version, f))
        self._arm()

    def _arm(self) -> None:
        while self.heap and self.heap[0].version != self.heap[0].flow.version:
            heapq.heappop(self.heap)
        if not self.heap:
            return
        eta = self.heap[0].eta_s
        if eta < self._armed - EPS:
            self._armed = eta
            self._token += 1
            t = self.env.timeout(max(0.0, eta - self.env.now))
            t.callbacks.append(lambda _e, token=self._token: self._wake(token))

    def _wake(self, token: int) -> None:
        if token != self._token:
            return  # superseded by an earlier completion armed since: that one re-arms
        self._armed = math.inf
        now = self.env.now
        done, affected = [], set()
        while self.heap:
            eta, _, version, f = self.heap[0]
            if version != f.version:
                heapq.heappop(self.heap)
                continue
            if eta > now + EPS * max(1.0, now):
                break
            heapq.heappop(self.heap)
            f.version += 1
            done.append(f)
        for f in done:
            for r, w in zip(f.resources, f.weights):
                self.load[r] -= w
                on = self.flows_on[r]
                on.discard(f)
                affected |= on
        affected -= set(done)
        thens = []
        for f in done:
            self.flows_done += 1
            if f.event.__class__ is simpy.Event:
                f.event.succeed()
            else:
                thens.append(f.event)
        if affected:
            self._rerate(affected)
        else:
            self._arm()
        for then in thens:
            then()
