"""A collective's or send/recv's fabric flows, planned once per group and reused.

Each phase of an algorithm (twin/sim/collectives.py) becomes one bundled fabric flow: ring
members move in lockstep, so the phase runs at the pace of its most loaded resource. A
resource's weight counts the transfers that cross it:

- every member's transfers, simulated or not (a folded member moves the same bytes as its
  representative, over its own links);
- under rank folding, the transfers of the group's copies (the same call on the ranks the
  folded shifts map the group to) that cross a resource of the group's own transfers: those
  copies run at the same instant and share the node's NICs, up/down links or cores.

With every rank simulated this is the phase's flows and nothing else; folded, the bundle
loads each resource as the full run does, so folding changes no time (tests/sim). Phases
are planned per op byte and memoized per (kind, group, root, role): the same groups recur at
every layer and micro-batch, so a step plans each group once.

``prepare`` plans every call of the programs before the run and merges resources that no
flow can tell apart: two links crossed by exactly the same bundles, with the same weight and
cost in each, and of the same capacity, always carry the same load, so one stands for both
(a ring over 128 nodes crosses 256 NICs that nothing else uses: one resource, not 256). The
fabric's work per flow then grows with what differs, not with the group's size.
"""

from __future__ import annotations

from itertools import product
from typing import NamedTuple

import numpy as np

from twin.cost import CostModel
from twin.sim.codes import op_codes
from twin.sim.collectives import Transfer, plan_collective
from twin.sim.records import Bundle
from twin.sim.topology import Resource, Topology
from twin.vocab import COLLECTIVE_KINDS, COMPUTE_KINDS, MEMORY_KINDS, P2P_KINDS

_LOCAL = frozenset(COMPUTE_KINDS) | frozenset(MEMORY_KINDS)
"""Kinds no flow is planned for."""


def collective_key(kind: str, group: tuple[int, ...], root: int, role: str) -> tuple:
    """The memo key of a collective call: its plan (FlowPlanner), its callers and its private
    timing (twin/sim/private.py) are kept under it."""
    return ("c", kind, group, root, role)


def call_key(op) -> tuple:
    """The memo key (``collective_key``) of a collective op."""
    return collective_key(op.kind, op.group, op.root, op.group_name)


class Planned(NamedTuple):
    """A call's phases per byte of its op: bundles (None: no transfer), latencies, fit."""

    bundles: tuple[Bundle | None, ...]
    """Each phase's bundle moving ``size_bytes`` per byte of the op (scaled by the fit)."""
    latencies_s: tuple[float, ...]
    base_latency_s: float
    """Added once, before the first phase."""

    def scaled(self, nbytes: float) -> list[Bundle | None]:
        return [None if b is None else b._replace(size_bytes=b.size_bytes * nbytes)
                for b in self.bundles]


class FlowPlanner:
    """Plans the bundles of collectives and send/recvs for one simulation (see the module
    docstring); ``shifts``: the folded shifts (twin.sim.records.folded_shifts: each a
    stride and a size; none: every rank simulated)."""

    def __init__(self, topo: Topology, cost: CostModel, algorithm: str, shifts=()):
        self.topo, self.cost, self.algorithm = topo, cost, algorithm
        self.shifts = tuple(s for s in shifts if s.size > 1)
        self._memo: dict[tuple, Planned] = {}
        self._fits: dict[tuple, dict | None] = {}
        self._uneven: dict[tuple, tuple] = {}  # (group, op name) -> its memo key
        self._sized: dict[tuple, tuple] = {}  # (p2p memo key, bytes) -> p2p's answer
        self.callers: dict[tuple, set[tuple[int, str]]] = {}
        """Memo key -> the (rank, stream) pairs that call it ("p2p" and "all_to_all" stand
        for transfers that may overlap): filled by ``prepare`` (twin/sim/private.py)."""
        self._merged = False

    def prepare(self, programs) -> None:
        """Plan every collective and send/recv of ``programs`` (rank -> Program), then merge
        the resources no bundle tells apart (see the module docstring). Only calls planned
        here may run after it."""
        seen: set[tuple] = set()
        rows: dict[tuple, dict[int, tuple[float, ...]]] = {}
        callers = self.callers
        for rank, prog in programs.items():
            ops = prog.ops  # (compute and memory ops plan nothing)
            for i in op_codes(prog).where(lambda op: op.kind not in _LOCAL):
                op = ops[i]
                kind = op.kind
                if op.send_splits:  # an uneven all-to-all: planned from every member's row
                    rows.setdefault((op.group, op.name, op.group_name, op.bytes), {})[rank] = \
                        op.send_splits
                elif kind in COLLECTIVE_KINDS:
                    key = call_key(op)
                    who = callers.get(key)
                    if who is None:
                        who = callers[key] = set()
                    who.add((rank, op.stream))
                    if key not in seen:
                        seen.add(key)
                        self.collective(op.kind, op.group, 0.0, op.group_name, op.root)
                elif kind in P2P_KINDS:
                    pair = (rank, op.peer) if kind == "send" else (op.peer, rank)
                    callers.setdefault(("p", *pair), set()).add((rank, "p2p"))
                    if pair not in seen:
                        seen.add(pair)
                        self.p2p(*pair, 0.0)
        for (group, name, role, nbytes), by_rank in rows.items():
            self._plan_uneven(group, name, role, nbytes, by_rank)
            for rank in by_rank:
                callers.setdefault(self._uneven[(group, name)], set()).add((rank, "all_to_all"))
        sig: dict[Resource, list] = {}
        for n, plan in enumerate(self._memo.values()):
            for k, b in enumerate(plan.bundles):
                if b is not None:
                    for r, w, c in zip(b.resources, b.weights, b.byte_costs):
                        sig.setdefault(r, []).append((n, k, w, c))
        cap = self.topo.capacity
        rep: dict[tuple, Resource] = {}
        one = {r: rep.setdefault((tuple(v), cap[r]), r) for r, v in sig.items()
               if r[0] != "cpu"}  # compute shares the cores outside the planner's bundles
        for key, plan in self._memo.items():
            self._memo[key] = plan._replace(bundles=tuple(
                None if b is None else _merge(b, one) for b in plan.bundles))
        self._merged = True

    # -- the public calls ------------------------------------------------------------------
    def collective(self, kind: str, group: tuple[int, ...], nbytes: float, role: str,
                   root: int = -1) -> tuple[list[Bundle | None], tuple[float, ...], float]:
        """(bundles, per-phase latencies, base latency) of one collective call."""
        key = collective_key(kind, group, root, role)
        plan = self._memo.get(key)
        if plan is None:
            self._unplanned(key)
            phases = plan_collective(kind, group, 1.0, self.topo, self.algorithm, root)
            bundles = [self._bundle(p.flows, group) for p in phases]
            plan = self._memo[key] = self._fit(kind, group, bundles,
                                                [p.latency_s for p in phases], role)
        return plan.scaled(nbytes), plan.latencies_s, plan.base_latency_s

    def uneven(self, group: tuple[int, ...], name: str,
               nbytes: float) -> tuple[list[Bundle | None], tuple[float, ...], float]:
        """(bundles, latencies, base latency) of the uneven all-to-all ``name`` on ``group``
        (planned by ``prepare`` from its members' send_splits)."""
        plan = self._memo[self._uneven[(group, name)]]
        return plan.scaled(nbytes), plan.latencies_s, plan.base_latency_s

    def _plan_uneven(self, group: tuple[int, ...], name: str, role: str, nbytes: float,
                     rows: dict[int, tuple[float, ...]]) -> None:
        """One phase in which every member sends its send_splits[j] to member j, per op byte;
        a resource's weight is the bytes crossing it over the largest flow's, so the phase
        lasts as long as its most loaded resource needs (the even case: the flow count)."""
        missing = [m for m in group if m not in rows]
        if missing:  # folding keeps EP groups whole (twin.schedule.builder.symmetric_shifts)
            raise ValueError(f"uneven all-to-all {name} on {group}: ranks {missing} are not "
                             "simulated (a fold split the EP group)")
        flows = [Transfer(a, b, rows[a][j] / nbytes) for a in group
                 for j, b in enumerate(group) if a != b and rows[a][j] > 0]
        key = ("v", group, role, tuple(flows))  # each flow's ends and bytes
        self._uneven[(group, name)] = key
        if key in self._memo:
            return
        bundle = None
        if flows:
            weights: dict[Resource, float] = {}
            amount = max(f.size_bytes for f in flows)
            for src, dst, size in flows:
                for r in self.topo.route(src, dst):
                    weights[r] = weights.get(r, 0.0) + size / amount
            for copy in self._copies(flows, group):  # the same rows on the group's copies
                for (src, dst), f in zip(copy, flows):
                    for r in self.topo.route(src, dst):
                        if r in weights:
                            weights[r] += f.size_bytes / amount
            res = tuple(weights)
            bundle = Bundle(res, tuple(weights[r] for r in res), amount,
                            tuple(self.topo.byte_cost(r) for r in res))
        lat = max(self.topo.alpha(group[0], m) for m in group)
        self._memo[key] = self._fit("all_to_all", group, [bundle], [lat], role)

    def p2p(self, src: int, dst: int, nbytes: float) -> tuple[Bundle | None, float]:
        """(bundle, latency before it) of one send/recv from ``src`` to ``dst`` (kept per
        size once planned: a pipeline sends one size between two stages thousands of times)."""
        key = ("p", src, dst)
        hit = self._sized.get((key, nbytes))
        if hit is not None:
            return hit
        plan = self._memo.get(key)
        if plan is None:
            self._unplanned(key)
            pair = (src, dst)
            bundle = self._bundle([Transfer(src, dst, 1.0)], pair)
            fitted = self._fit("sendrecv", pair, [bundle], [0.0], "")
            link = "inter" if self.topo.inter(src, dst) else "intra"
            if self._fit_of("sendrecv", link, 2, "") is not None:
                lat = fitted.base_latency_s
            elif self.cost.p2p_latency_us is not None:
                lat = self.cost.p2p_latency_us * 1e-6
            else:
                lat = self.topo.alpha(src, dst)
            plan = self._memo[key] = Planned(fitted.bundles, (lat,), 0.0)
        out = plan.scaled(nbytes)[0], plan.latencies_s[0]
        if self._merged:  # (a bundle planned before prepare's merge names unmerged links)
            self._sized[(key, nbytes)] = out
        return out

    # -- planning ---------------------------------------------------------------------------
    def _unplanned(self, key: tuple) -> None:
        if self._merged:
            raise RuntimeError(f"{key} was not planned before the run (FlowPlanner.prepare): "
                               "its links may have been merged with others")

    def _bundle(self, flows: list[Transfer], group: tuple[int, ...]) -> Bundle | None:
        """One bundle for a phase's flows per op byte (see the module docstring)."""
        if not flows:
            return None
        topo = self.topo
        weights: dict[Resource, float] = {}
        amount = 0.0
        for src, dst, nbytes in flows:
            for r in topo.route(src, dst):
                weights[r] = weights.get(r, 0.0) + 1.0
            amount = max(amount, nbytes)
        for flow_copies in self._copies(flows, group):
            for src, dst in flow_copies:
                for r in topo.route(src, dst):
                    if r in weights:
                        weights[r] += 1.0
        res = tuple(weights)
        return Bundle(res, tuple(weights[r] for r in res), amount,
                      tuple(topo.byte_cost(r) for r in res))

    def _copies(self, flows: list[Transfer], group: tuple[int, ...]):
        """The flows of each copy of ``group`` under folding that touches a node of the
        group's own flows (copies elsewhere share no resource with them)."""
        if not self.shifts:
            return
        moving = [s for s in self.shifts if len({s.value(m) for m in group}) == 1]
        if not moving:
            return  # the group spans every folded shift: its copies are the group itself
        gpn = self.topo.gpn
        ends = np.array([e for f in flows for e in (f.src, f.dst)], dtype=np.int64)
        sizes = np.array([s.size for s in moving], dtype=np.int64)
        stride = np.array([s.stride for s in moving], dtype=np.int64)
        coords = (ends[:, None] // stride) % sizes  # endpoint x axis
        shifts = np.array(list(product(*(range(n) for n in sizes)))[1:], dtype=np.int64)
        # moved[s, e]: endpoint e of the copy ``shifts[s]`` away (coordinates wrap per axis)
        moved = ends + (((coords[None] + shifts[:, None]) % sizes - coords[None])
                        * stride).sum(axis=2)
        near = np.isin(moved // gpn, np.unique(ends // gpn)).any(axis=1)
        for row in moved[near].tolist():
            yield list(zip(row[0::2], row[1::2]))

    def _fit_of(self, kind: str, link: str, n: int, role: str) -> dict | None:
        key = (kind, link, n, role)
        if key not in self._fits:
            self._fits[key] = self.cost.collective_fit(kind, link, n, role)
        return self._fits[key]

    def _fit(self, kind: str, group: tuple[int, ...], bundles: list[Bundle | None],
             lat: list[float], role: str) -> Planned:
        """Apply a measured latency/bandwidth fit: same phases and contention, scaled so the
        uncontended time is the fit's latency + S / bw (per op byte: S = 1)."""
        link = "inter" if self.topo.grid.nodes_spanned(group) > 1 else "intra"
        fit = self._fit_of(kind, link, len(group), role)
        if fit is None:
            return Planned(tuple(bundles), tuple(lat), self.cost.base_latency_us * 1e-6)
        ideal = sum(self._uncontended_s(b) for b in bundles if b is not None)
        want = 1.0 / (fit["bw_GBps"] * 1e9)
        scale = want / ideal if ideal > 0 else 1.0
        bundles = [None if b is None else b._replace(size_bytes=b.size_bytes * scale)
                   for b in bundles]
        return Planned(tuple(bundles), (0.0,) * len(lat), fit["latency_us"] * 1e-6)

    def _uncontended_s(self, b: Bundle) -> float:
        cap = self.topo.capacity
        return b.size_bytes / min(cap[r] / (x * c)
                                  for r, x, c in zip(b.resources, b.weights, b.byte_costs))


def _merge(b: Bundle, one: dict[Resource, Resource]) -> Bundle:
    """``b`` over the representatives of its resources (each once: merged ones share weights)."""
    out: dict[Resource, int] = {}
    for k, r in enumerate(b.resources):
        out.setdefault(one.get(r, r), k)
    if len(out) == len(b.resources):
        return b._replace(resources=tuple(out))
    return Bundle(tuple(out), tuple(b.weights[k] for k in out.values()), b.size_bytes,
                  tuple(b.byte_costs[k] for k in out.values()))
