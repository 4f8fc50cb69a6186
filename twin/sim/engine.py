"""The SimPy engine: one process per rank and FIFO stream, rendezvous for collectives
and send/recv, transfers and shared cores through the fabric.

Per the IR's stream semantics (twin/schedule/ir.py): an op starts when the previous op of
its stream has finished and its dependencies are done. Runs of compute ops that nobody on
another stream waits for are advanced with one timeout (their spans follow by
arithmetic), so events scale with the synchronisation points, not with the ops. Memory
ops take no time: each happens when its last dependency ends, computed after the run.

Rank folding: ranks that are copies of each other along the folded axes (dp, tp; under
expert parallelism the shifts that keep expert groups, twin.schedule.builder) are simulated
once; their collectives complete when the simulated members arrive, and every member's
flows, and the flows of the group's copies on the links the group uses, load the fabric as
in the full run (twin/sim/flows.py); compute on shared cores counts once per copy.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import simpy

from twin.cost import CostModel
from twin.schedule.ir import Op, Program
from twin.sim.fabric import Fabric
from twin.sim.flows import FlowPlanner
from twin.sim.host import HostPlan, host_plan
from twin.sim.records import (  # noqa: F401 - SimOptions, fold_classes: public here
    Bundle,
    P2PPair,
    PairKey,
    Rendezvous,
    RendezvousKey,
    SimOptions,
    Structure,
    fold_classes,
    folded_shifts,
)
from twin.sim.topology import Topology
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
        self.flows = FlowPlanner(self.topo, cost, options.algorithm,
                                 folded_shifts(job, options.fold) if len(classes) < world else ())
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
        self._core_weights: dict[int, tuple[float]] = {}
        self._members: dict[tuple[int, ...], int] = {}  # group -> its simulated members
        self._compute_times: dict[tuple, float] = {}  # compute op signature -> base seconds
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

    def _core_weight(self, rank: int, node: int) -> tuple[float]:
        """How many copies of ``rank`` (itself included) compute on its node's shared cores at
        once: folded copies run the same op at the same instant."""
        w = self._core_weights.get(rank)
        if w is None:
            copies = self.classes.get(rank)
            if copies is None:  # not a representative (hand-made classes): find its class
                of = {m: rep for rep, ms in self.classes.items() for m in ms}
                copies = self.classes.get(of.get(rank, rank), [rank])
            grid = self.topo.grid
            w = self._core_weights[rank] = (float(max(1, sum(grid.node(c) == node
                                                             for c in copies))),)
        return w

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
            if op.send_splits:  # an uneven all-to-all (MoE dispatch): per-peer bytes
                bundles, lats, base = self.flows.uneven(op.group, op.name, op.bytes)
            else:
                bundles, lats, base = self.flows.collective(op.kind, op.group, op.bytes,
                                                            op.group_name, op.root)
            self._next_phase(bundles, lats, 0, rv.done, self._noise(self.cost.comm_cv), base)
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
        bundle, lat = self.flows.p2p(src, dst, op.bytes)
        yield self.env.timeout(lat * self._noise(self.cost.comm_cv))
        ev = self._start(bundle)
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
            members = self._members.get(op.group)
            if members is None:
                members = self._members[op.group] = sum(1 for m in op.group
                                                        if m in self.simulated)
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
                    yield self.fabric.transfer((("cpu", node),), dur, cap=1.0,
                                               weights=self._core_weight(rank, node))
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
        ext_deps = [tuple(d for d in op.deps if d in external) if op.deps else ()
                    for op in ops]
        gpu, cost, times = self.job.cluster.gpu, self.cost, self._compute_times
        base = [0.0] * len(ops)
        for i, op in enumerate(ops):  # the same shapes recur at every layer and micro-batch
            if op.is_compute:
                sig = (op.kind, op.dtype, op.shape, op.flops, op.bytes)
                t = times.get(sig)
                if t is None:
                    t = times[sig] = cost.compute_time(op, gpu)
                base[i] = t
        out = Structure(streams, external, ext_deps, base, host)
        self._structures[key] = out
        return out

    def structure_of(self, rank: int) -> Structure:
        """The stream structure of ``rank``'s program (see Structure)."""
        return self._structure(rank, self.programs[rank])

    def run(self) -> float:
        """Simulate; returns the step time in seconds."""
        self.flows.prepare(self.programs)
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
