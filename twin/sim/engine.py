"""The SimPy engine: one process per rank and FIFO stream, rendezvous for collectives
and send/recv, transfers and shared cores through the fabric.

Per the IR's stream semantics (twin/schedule/ir.py): an op starts when the previous op of
its stream has finished and its dependencies are done. Runs of compute ops that nobody on
another stream waits for are advanced with one timeout (their spans follow by
arithmetic), so events scale with the synchronisation points, not with the ops. Memory
ops take no time: each happens when its last dependency ends, computed after the run.

Rank folding: ranks that are copies of each other along the folded axes (dp, tp) are
simulated once; their collectives complete when the simulated members arrive, and
their flows count once per copy on the resources the copies share (NIC, loopback, cores).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import simpy

from twin.cost import CostModel
from twin.schedule.ir import Op, Program
from twin.sim.collectives import Transfer, plan_collective
from twin.sim.fabric import Fabric
from twin.sim.host import HostPlan, host_plan
from twin.sim.records import (  # noqa: F401 - SimOptions, fold_classes: public here
    Bundle,
    Fitted,
    P2PPair,
    PairKey,
    Rendezvous,
    RendezvousKey,
    SimOptions,
    Structure,
    fold_classes,
)
from twin.sim.topology import Resource, Topology
from twin.spec import Job

FIFO_UNORDERED = ("p2p", "mem")

class Simulation:
    """One simulated step of a schedule."""

    def __init__(self, job: Job, programs: dict[int, Program], cost: CostModel,
                 options: SimOptions, classes: dict[int, list[int]]):
        self.job, self.programs, self.cost, self.opt = job, programs, cost, options
        self.env = simpy.Environment()
        self.topo = Topology(job.cluster, job.grid, cost, options.degraded or None)
        world = job.grid.world_size
        if sum(map(len, classes.values())) == world:  # fold_classes: a partition of the world
            every = range(world)
        else:
            every = sorted({m for members in classes.values() for m in members})
        self.fabric = Fabric(self.env, self.topo.resources_for(every))
        self.classes = classes
        self.simulated = set(programs)
        self.rng = np.random.default_rng(options.seed)
        self.events = 0
        self.start: dict[int, np.ndarray] = {r: np.zeros(len(p.ops)) for r, p in programs.items()}
        self.end: dict[int, np.ndarray] = {r: np.zeros(len(p.ops)) for r, p in programs.items()}
        self._rv: dict[RendezvousKey, Rendezvous] = {}
        self._pairs: dict[PairKey, P2PPair] = {}
        self._structures: dict[tuple[str, int], Structure] = {}
        self.core_share = job.cluster.cores_per_node is not None and cost.core_share
        self._class_of: dict[int, int] | None = None  # member -> representative, when asked
        self._copy_weights: dict[tuple[int, tuple[Resource, ...]], tuple[float, ...]] = {}
        self._inflight_comm = {r: 0 for r in programs}
        self.ops_done = 0
        self.on_progress: Callable[[int], None] | None = None
        """(ops_done): every 16,384 ops and after planning a collective over 1,024+ ranks."""

    # -- helpers ------------------------------------------------------------------------
    def _noise(self, cv: float) -> float:
        if not self.opt.jitter or cv <= 0:
            return 1.0
        sigma = math.sqrt(math.log(1 + cv * cv))
        return float(self.rng.lognormal(-sigma * sigma / 2, sigma))

    def _weights(self, src: int, resources: tuple[Resource, ...]) -> tuple[float, ...]:
        """How many copies of ``src``'s flow share each resource (folded ranks); memoized per
        (src, resources), as the same routes recur at every collective."""
        copies = self.classes.get(src)
        if copies is None:  # not a representative (hand-made classes): find its class
            if self._class_of is None:
                self._class_of = {m: rep for rep, ms in self.classes.items() for m in ms}
            copies = self.classes.get(self._class_of.get(src, src), [src])
        if len(copies) == 1:
            return (1.0,) * len(resources)
        key = (src, resources)
        memo = self._copy_weights.get(key)
        if memo is not None:
            return memo
        topo = self.topo
        w = []
        for res in resources:
            if res[0] in ("up", "down", "cpu"):
                w.append(float(sum(topo.grid.node(c) == res[1] for c in copies)))
            elif res[0] in ("nic_out", "nic_in"):
                w.append(float(sum(topo.grid.node(c) == res[1] and topo.nic(c) == res[2]
                                   for c in copies)))
            else:
                w.append(1.0)
        memo = self._copy_weights[key] = tuple(max(x, 1.0) for x in w)
        return memo

    def _bundle_spec(self, flows: list[Transfer]) -> Bundle | None:
        """One fabric flow for a phase's flows: ring members move in lockstep, so the phase
        runs at the pace of its most loaded resource. Each resource is weighted by how many
        of the phase's flows (and their folded copies) cross it; the bundle moves the
        largest per-flow byte count. None when no simulated rank sends."""
        weights: dict[Resource, float] = {}
        amount = 0.0
        for src, dst, nbytes in flows:
            if src not in self.simulated:
                continue  # a folded copy: its simulated representative moves the same bytes
            res = self.topo.route(src, dst)
            for r, w in zip(res, self._weights(src, res)):
                weights[r] = weights.get(r, 0.0) + w
            amount = max(amount, nbytes)
        if not weights:
            return None
        res = tuple(weights)
        return Bundle(res, tuple(weights[r] for r in res), amount,
                      tuple(self.topo.byte_cost(r) for r in res))

    def _uncontended_s(self, b: Bundle) -> float:
        cap = self.fabric.capacity
        return b.size_bytes / min(cap[r] / (x * c)
                                  for r, x, c in zip(b.resources, b.weights, b.byte_costs))

    def _fitted(self, kind: str, group: tuple[int, ...], nbytes: float,
                specs: list[Bundle | None], lat: list[float], role: str = "") -> Fitted:
        """Apply a measured latency/bandwidth fit: same phases and contention, scaled so the
        uncontended time is the fit's latency + S / bw."""
        link = "inter" if self.topo.grid.nodes_spanned(group) > 1 else "intra"
        fit = self.cost.collective_fit(kind, link, len(group), role)
        if fit is None:
            return Fitted(specs, lat, self.cost.base_latency_us * 1e-6)
        ideal = sum(self._uncontended_s(sp) for sp in specs if sp is not None)
        want = nbytes / (fit["bw_GBps"] * 1e9)
        scale = want / ideal if ideal > 0 else 1.0
        specs = [None if sp is None else Bundle(sp.resources, sp.weights, sp.size_bytes * scale,
                                                sp.byte_costs) for sp in specs]
        return Fitted(specs, [0.0] * len(lat), fit["latency_us"] * 1e-6)

    def _start(self, b: Bundle | None) -> simpy.Event | None:
        if b is None:
            return None
        return self.fabric.transfer(b.resources, b.size_bytes, weights=b.weights,
                                    costs=b.byte_costs)

    # -- processes ------------------------------------------------------------------------
    def _arrive(self, rank: int, op: Op, evs: dict[int, simpy.Event], i: int) -> simpy.Event:
        """This rank reaches a collective; the last simulated member starts it."""
        rv = self._rendezvous(op)
        evs[i] = rv.done
        rv.members_left -= 1
        if rv.members_left == 0:
            del self._rv[(op.group, op.name)]
            ph = plan_collective(op.kind, op.group, op.bytes, self.topo, self.opt.algorithm,
                                 op.root)
            specs = [self._bundle_spec(p.flows) for p in ph]
            fit = self._fitted(op.kind, op.group, op.bytes, specs, [p.latency_s for p in ph], op.group_name)
            self._next_phase(fit.bundles, fit.latencies_s, 0, rv.done,
                             self._noise(self.cost.comm_cv), fit.base_latency_s)
            if self.on_progress and len(op.group) >= 1024:
                self.on_progress(self.ops_done)  # planning a large group takes a while: say so
        self.events += 1
        return rv.done

    def _next_phase(self, specs: list[Bundle | None], lats: list[float], k: int,
                    done: simpy.Event, noise: float, extra: float) -> None:
        """Run phase k (latency, then its bundled flow) by callbacks, then the next."""
        if k == len(specs):
            done.succeed()
            return
        lat = (lats[k] + extra) * noise

        def start(_=None):
            ev = self._start(specs[k])
            self.events += 2
            if ev is None:
                self._next_phase(specs, lats, k + 1, done, noise, 0.0)
            else:
                ev.callbacks.append(lambda _e: self._next_phase(specs, lats, k + 1, done, noise, 0.0))

        if lat > 0:
            self.env.timeout(lat).callbacks.append(start)
        else:
            start()

    def _p2p(self, rank: int, i: int, op: Op, evs: dict[int, simpy.Event], external: set[int],
             host: HostPlan | None = None):
        waits = [ev for ev in (self._event_of(rank, self.programs[rank].ops[d], evs, d)
                               for d in op.deps if d in external) if not ev.triggered]
        if waits:
            yield self.env.all_of(waits)
        if host is not None:  # the host has not issued it yet
            yield from self._issued(rank, i, host, evs)
        src, dst = (rank, op.peer) if op.kind == "send" else (op.peer, rank)
        key = (src, dst, op.tag)
        self.start[rank][i] = self.env.now
        pair = self._pairs.get(key)
        if pair is None:
            pair = self._pairs[key] = P2PPair(self.env.event())
        pair.arrived += 1
        if pair.arrived == 2 or (op.peer not in self.simulated):
            del self._pairs[key]
            self.env.process(self._run_p2p(src, dst, op, pair.done))
        yield pair.done
        self.end[rank][i] = self.env.now
        self.events += 2
        if i in external:
            evs[i].succeed()

    def _run_p2p(self, src: int, dst: int, op: Op, done: simpy.Event):
        flows = [Transfer(src, dst, op.bytes)] if src in self.simulated \
            else [Transfer(dst, src, op.bytes)]
        spec = self._bundle_spec(flows)
        lat = self.cost.p2p_latency_us * 1e-6 if self.cost.p2p_latency_us is not None \
            else self.topo.alpha(src, dst)
        fit = self._fitted("sendrecv", (src, dst), op.bytes, [spec], [0.0])
        if self.cost.collective_fit("sendrecv", "inter" if self.topo.inter(src, dst) else "intra",
                                    2) is not None:
            lat = fit.base_latency_s
        yield self.env.timeout(lat * self._noise(self.cost.comm_cv))
        ev = self._start(fit.bundles[0])
        if ev is not None:
            yield ev
        done.succeed()

    def _event_of(self, rank: int, op: Op, evs: dict[int, simpy.Event], i: int) -> simpy.Event:
        """The completion event of op ``i`` (a collective's is its rendezvous event)."""
        ev = evs.get(i)
        if ev is None:
            ev = evs[i] = self._rendezvous(op).done
        return ev

    def _rendezvous(self, op: Op) -> Rendezvous:
        key = (op.group, op.name)
        rv = self._rv.get(key)
        if rv is None:
            members = sum(1 for m in op.group if m in self.simulated)
            rv = self._rv[key] = Rendezvous(members, self.env.event())
        return rv

    def _issued(self, rank: int, i: int, host: HostPlan, evs: dict[int, simpy.Event]):
        """Wait (a process step) until the host has issued op ``i``: past its sync point's
        ops, then its issue time. Returns when the op may start."""
        s = host.sync_of[i]
        ready = host.issue_s[i]
        if s >= 0:
            ops = self.programs[rank].ops
            waits = [ev for ev in (self._event_of(rank, ops[w], evs, w) for w in host.waits[s])
                     if not ev.triggered]
            if waits:
                yield self.env.all_of(waits)
                self.events += 1
            end = self.end[rank]
            ready = max(ready, max(float(end[w]) for w in host.waits[s]) + host.offset_s(i))
        if ready > self.env.now:
            yield self.env.timeout(ready - self.env.now)

    def _stream(self, rank: int, indices: list[int], evs: dict[int, simpy.Event],
                external: set[int], ext_deps: list[tuple[int, ...]], base: list[float],
                host: HostPlan | None = None):
        ops = self.programs[rank].ops
        env = self.env
        st, en = self.start[rank], self.end[rank]
        pending = 0.0  # compute time advanced arithmetically, not yet waited for
        node = self.job.grid.node(rank)
        slow = self.opt.straggler.get(rank, 1.0)
        jitter = self.opt.jitter and self.cost.compute_cv > 0
        overlap = self.cost.overlap_slowdown
        core_share = self.core_share
        for i in indices:
            op = ops[i]
            self.ops_done += 1
            if not self.ops_done & 16383 and self.on_progress:
                self.on_progress(self.ops_done)
            deps = ext_deps[i]
            if deps:
                waits = [ev for ev in (self._event_of(rank, ops[d], evs, d) for d in deps)
                         if not ev.triggered]
                if waits:
                    if pending:
                        yield env.timeout(pending)
                        pending = 0.0
                    yield waits[0] if len(waits) == 1 else env.all_of(waits)
                    self.events += 1
            if host is not None and (host.sync_of[i] >= 0 or host.issue_s[i] > env.now + pending):
                if op.is_compute and not core_share and host.sync_of[i] < 0:
                    pending = host.issue_s[i] - env.now  # not issued yet: the device idles
                else:
                    if pending:
                        yield env.timeout(pending)
                        pending = 0.0
                    yield from self._issued(rank, i, host, evs)
            if op.is_compute:
                dur = base[i] * slow
                if jitter:
                    dur *= self._noise(self.cost.compute_cv)
                if overlap and self._inflight_comm[rank]:
                    dur *= 1 + overlap
                if core_share:
                    if pending:
                        yield env.timeout(pending)
                        pending = 0.0
                    st[i] = env.now
                    res = (("cpu", node),)
                    yield self.fabric.transfer(res, dur, cap=1.0, weights=self._weights(rank, res))
                    en[i] = env.now
                    self.events += 1
                else:
                    st[i] = env.now + pending
                    pending += dur
                    en[i] = env.now + pending
                    if i in external or overlap:
                        yield env.timeout(pending)
                        pending = 0.0
                        self.events += 1
                if i in external:
                    evs[i].succeed()
            else:  # a collective on a comm stream
                if pending:
                    yield env.timeout(pending)
                    pending = 0.0
                st[i] = env.now
                self._inflight_comm[rank] += 1
                yield self._arrive(rank, op, evs, i)
                self._inflight_comm[rank] -= 1
                en[i] = env.now
        if pending:
            yield env.timeout(pending)

    def _structure(self, rank: int, prog: Program) -> Structure:
        """Streams, external deps and base compute times of a program; shared by every rank
        of a pipeline stage (their programs differ only in global ranks)."""
        key = ("template", prog.template) if prog.template is not None else ("rank", rank)
        cached = self._structures.get(key)
        if cached is not None:
            return cached
        ops = prog.ops
        streams: dict[str, list[int]] = {}
        external: set[int] = set()
        for i, op in enumerate(ops):
            if op.stream == "mem":
                continue  # timed after the run from its dependencies
            streams.setdefault(op.stream, []).append(i)
            for d in op.deps:
                if ops[d].stream != op.stream or op.stream == "p2p":
                    external.add(d)
        host = host_plan(ops, self.cost)
        if host is not None:
            for waited in host.waits.values():
                external.update(waited)  # the host waits for them: they need events
        ext_deps = [tuple(d for d in op.deps if d in external) for op in ops]
        gpu = self.job.cluster.gpu
        base = [self.cost.compute_time(op, gpu) if op.is_compute else 0.0 for op in ops]
        out = Structure(streams, external, ext_deps, base, host)
        self._structures[key] = out
        return out

    def structure_of(self, rank: int) -> Structure:
        """The stream structure of ``rank``'s program (see Structure)."""
        return self._structure(rank, self.programs[rank])

    def run(self) -> float:
        """Simulate; returns the step time in seconds."""
        for rank, prog in self.programs.items():
            streams, external, ext_deps, base, host = self._structure(rank, prog)
            ops = prog.ops
            evs = {i: self.env.event() for i in external if not ops[i].is_collective}
            for s, idx in streams.items():
                if s == "p2p":
                    for i in idx:
                        self.env.process(self._p2p(rank, i, ops[i], evs, external, host))
                else:
                    self.env.process(self._stream(rank, idx, evs, external, ext_deps, base,
                                                  host))
        self.env.run()
        stuck = [k for k, rv in self._rv.items() if rv.members_left > 0]
        stuck += list(self._pairs)
        if stuck:
            raise RuntimeError(f"simulation ended with {len(stuck)} collectives or p2p waiting "
                               f"(first: {stuck[0]}): the schedule deadlocks")
        self._memory_times()
        return max(float(e.max()) if len(e) else 0.0 for e in self.end.values())

    def _memory_times(self) -> None:
        for rank, prog in self.programs.items():
            st, en = self.start[rank], self.end[rank]
            for i, op in enumerate(prog.ops):
                if op.stream == "mem":
                    t = max((en[d] for d in op.deps), default=0.0)
                    st[i] = en[i] = t
