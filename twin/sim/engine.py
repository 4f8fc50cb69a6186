"""The SimPy engine: one process per rank and FIFO stream, rendezvous for collectives
and send/recv, transfers and shared cores through the fabric.

Per the IR's stream semantics (twin/schedule/ir.py): an op starts when the previous op of
its stream has finished and its dependencies are done. Runs of compute ops that nobody on
another stream waits for are advanced with one timeout (their spans follow by
arithmetic), and so are the calls no other stream's flows meet (twin/sim/private.py), so
events scale with the synchronisation points, not with the ops. Memory ops take no time:
each happens when its last dependency ends, computed after the run.

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
from twin.schedule.ir import Program
from twin.sim.calls import Calls
from twin.sim.codes import op_codes
from twin.sim.fabric import EPS, Contended, Fabric
from twin.sim.flows import FlowPlanner
from twin.sim.host import HostPlan, host_plan
from twin.sim.overlap import ComputeClock
from twin.sim.private import COMPUTE, Inliner, finish
from twin.sim.records import (  # noqa: F401 - SimOptions, fold_classes: public here
    Bundle,
    Events,
    P2PPair,
    PairKey,
    Rendezvous,
    RendezvousKey,
    SimOptions,
    Structure,
    ended,
    fire_op,
    fold_classes,
    folded_shifts,
)
from twin.sim.sendrecv import SendRecv
from twin.sim.thread import issue_cost, thread_charges
from twin.sim.topology import Topology
from twin.sim.walks import Walk, memory_times, structure, walk_of
from twin.spec import Job

FIFO_UNORDERED = ("p2p", "mem")


def env_all(env: simpy.Environment, events: list[simpy.Event]) -> simpy.Event:
    """What waiting for every one of ``events`` yields (the event itself when one)."""
    return events[0] if len(events) == 1 else env.all_of(events)


class Simulation(Calls):
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
        # each op's start and end: lists while the step runs (one entry read or written at a
        # time), arrays once it has run
        self.start: dict[int, np.ndarray] = {r: [0.0] * len(p.ops) for r, p in programs.items()}
        self.end: dict[int, np.ndarray] = {r: [0.0] * len(p.ops) for r, p in programs.items()}
        self._rv: dict[RendezvousKey, Rendezvous] = {}
        self._pairs: dict[PairKey, P2PPair] = {}
        self._mirrors: dict[int, set[tuple[str, str]]] = {}  # (sendrecv.has_mirror)
        self._structures: dict[tuple[str, int], Structure] = {}
        self.core_share = job.cluster.cores_per_node is not None and cost.core_share
        self._core_weights: dict[int, tuple[float]] = {}
        self.computing: dict[int, float] = {}
        """Shared cores: node -> ranks computing there now (folded copies counted)."""
        self._members: dict[tuple[int, ...], int] = {}  # group -> its simulated members
        self._inflight_comm = {r: 0 for r in programs}
        self._clocks: dict[int, list[ComputeClock]] = {r: [] for r in programs}
        self._synced: dict[int, dict[int, float]] = {}  # rank -> sync point -> host resumes
        self._walks: dict[tuple, Walk] = {}
        self.inline_private = True
        """Time private calls by arithmetic (twin/sim/private.py); False: every call goes
        through the fabric (the reference the tests compare with)."""
        self.ops_done = 0
        self.on_progress: Callable[[int], None] | None = None
        """(ops_done): every 4,096 ops of a stream, after planning a collective over 1,024+
        ranks."""
        self.on_setup: Callable[[int, int], None] | None = None
        """(ranks prepared, ranks): after each rank's walks before the run."""

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

    # -- processes ------------------------------------------------------------------------
    def _sync(self, rank: int, s: int, host: HostPlan, evs: dict[int, simpy.Event]):
        """Wait (a process step) for the ops the host waits for at sync point ``s``; record
        when the last of them ended (the host resumes issuing then)."""
        ops = self.programs[rank].ops
        waits = [ev for ev in (self._event_of(rank, ops[w], evs, w) for w in host.waits[s])
                 if not ev.processed]
        if waits:  # all_of even for one: it fires after the streams recorded their ends
            yield self.env.all_of(waits)
            self.events += 1
        self._synced[rank][s] = self._sync_time(rank, s, host)

    def _sync_time(self, rank: int, s: int, host: HostPlan) -> float:
        """When the last op the host waits for at sync point ``s`` ended, once all have. A
        call whose event is processed at this instant ended now though its end may be
        unwritten (0) yet: SimPy marks an event processed before it runs its callbacks, and
        the call's stream resumes (and writes its end) after a waiter registered before it."""
        ops, end, now = self.programs[rank].ops, self.end[rank], self.env.now
        return max(float(end[w]) if end[w] or ops[w].is_compute else now for w in host.waits[s])

    def _stream(self, rank: int, indices: list[int], evs: dict[int, simpy.Event],
                walk: Walk, st_: Structure, inline: dict[int, tuple] | None = None):
        """One FIFO stream's process; ``inline``: ops of private streams it times too
        (op -> (steps, shared resources, stream): twin/sim/private.py), each after its
        stream's previous one. ``now`` is the clock, read again after every yield."""
        ops = self.programs[rank].ops
        env = self.env
        st, en = self.start[rank], self.end[rank]
        external, ext_deps, cross = walk.external, walk.ext_deps, walk.cross
        base, is_compute, host = st_.base_s, st_.is_compute, st_.host
        sync_of, issue = (host.sync_of, host.issue_s) if host is not None else (None, None)
        inline = inline or {}
        pending = 0.0  # compute time advanced arithmetically, not yet waited for
        node = self.job.grid.node(rank)
        slow = self.opt.straggler.get(rank, 1.0)
        jitter = self.opt.jitter and self.cost.compute_cv > 0
        overlap = self.cost.overlap_slowdown
        core_share = self.core_share
        plain = not (jitter or overlap or core_share)  # compute advanced by arithmetic alone
        clock = None  # overlap: the stream's compute, re-timed as calls start and end
        if overlap and not core_share:
            clock = ComputeClock(env, overlap, st, en)
            self._clocks[rank].append(clock)
        synced = self._synced[rank]  # sync point -> when the host's waits there ended
        free: dict[str, float] = {}  # inlined stream -> when its last op ends
        s_last, t_s, h_s = -1, 0.0, 0.0  # the sync point of the op before, when it ended, H_s
        now = env.now
        for k0 in range(0, len(indices), 4096):
            if k0:
                self.ops_done += 4096
                if self.on_progress:
                    self.on_progress(self.ops_done)
            for i in indices[k0:k0 + 4096]:
                deps = ext_deps[i]
                if deps:
                    waits = []
                    for d in deps:
                        ev = evs.get(d)
                        if ev is None:  # a collective's: its rendezvous event (_event_of)
                            ev = self._event_of(rank, ops[d], evs, d)
                        if not ev.triggered:
                            waits.append(ev)
                    if waits:
                        if pending:
                            yield self._held(clock, pending)
                            pending = 0.0
                        yield env_all(env, waits)
                        now = env.now
                        self.events += 1
                ready = 0.0  # when the host has issued it and its own walk's deps are done
                if sync_of is not None:
                    s = sync_of[i]
                    if s >= 0:
                        if s != s_last:
                            t = synced.get(s)
                            if t is None:  # the host waits for the device here: once per sync
                                if pending:
                                    yield self._held(clock, pending)
                                    pending = 0.0
                                yield from self._sync(rank, s, host, evs)
                                now = env.now
                                t = synced[s]
                            s_last, t_s, h_s = s, t, issue[s]
                        h = issue[i]
                        ready = t_s + (h - h_s)
                        if not ready > h:  # max(h, ready)
                            ready = h
                    else:
                        ready = issue[i]
                c = cross[i]
                if c:
                    for d in c:
                        if en[d] > ready:
                            ready = en[d]
                if i in inline:  # a private call: timed, no events
                    steps, shared, stream = inline[i]
                    t = max(ready, free.get(stream, 0.0))
                    end = finish(t, steps)
                    if t < now * (1 - EPS) and (shared or i in external):
                        raise Contended(f"{ops[i].name} starts before the walk reaches it")
                    if shared:
                        self.inliner.reserve(shared, t, end, (rank, stream))
                    st[i] = t
                    en[i] = free[stream] = end
                    if i in external:  # another process (the host's sync) waits for it
                        env.timeout(max(0.0, end - now)).callbacks.append(
                            lambda _e, i=i: fire_op(evs, i))
                    continue
                if ready > now + pending:  # not issued or not ready yet: the device idles
                    pending = ready - now
                if not is_compute[i]:  # a collective on a comm stream
                    if pending:
                        yield self._held(clock, pending, ready)
                        pending = 0.0
                    st[i] = env.now
                    self._in_flight(rank, 1)
                    yield self._arrive(rank, ops[i], evs, i)
                    self._in_flight(rank, -1)
                    now = en[i] = env.now
                    continue
                if plain:
                    st[i] = now + pending
                    pending += base[i] * slow
                    en[i] = now + pending
                    if i in external:
                        yield env.timeout(pending)
                        now = env.now
                        pending = 0.0
                        self.events += 1
                        fire_op(evs, i)
                    continue
                dur = base[i] * slow
                if jitter:
                    dur *= self._noise(self.cost.compute_cv)
                if clock is not None:
                    pending = clock.add(i, ready, dur) - now
                    if i in external:
                        yield clock.hold()
                        now = env.now
                        pending = 0.0
                        self.events += 1
                        fire_op(evs, i)
                    continue
                if overlap and self._inflight_comm[rank]:  # (shared cores: at its start)
                    dur *= 1 + overlap
                if core_share:
                    if pending:
                        yield env.timeout(pending)
                        pending = 0.0
                    st[i] = env.now
                    w = self._core_weight(rank, node)
                    self.computing[node] = self.computing.get(node, 0.0) + w[0]
                    yield self.fabric.transfer((("cpu", node),), dur, cap=1.0, weights=w)
                    self.computing[node] -= w[0]
                    now = en[i] = env.now
                    self.events += 1
                else:
                    st[i] = now + pending
                    pending += dur
                    en[i] = now + pending
                    if i in external:
                        yield env.timeout(pending)
                        now = env.now
                        pending = 0.0
                        self.events += 1
                if i in external:
                    fire_op(evs, i)
        self.ops_done += len(indices) - 4096 * max(0, (len(indices) - 1) // 4096)
        if pending:
            yield self._held(clock, pending)
        if clock is not None:
            self.events += clock.events  # wake-ups moved by a change of rate

    def _held(self, clock: ComputeClock | None, pending: float, floor: float = 0.0):
        """What a stream waits for before its next event: its clock's run to end (and then
        ``floor``), else ``pending`` seconds of arithmetic and idling."""
        if clock is None or not clock.running():
            return self.env.timeout(pending)
        return clock.hold(floor)

    def slowed_s(self, rank: int, i: int) -> float:
        """Seconds op ``i`` of ``rank`` took past its work, beside calls (overlap_slowdown)."""
        return sum(c.slowed.get(i, 0.0) for c in self._clocks[rank])

    def _in_flight(self, rank: int, delta: int) -> None:
        """A collective of ``rank`` starts (1) or ends (-1): compute beside it slows."""
        self._inflight_comm[rank] += delta
        for clock in self._clocks[rank]:
            clock.comm(delta)

    def _structure(self, rank: int, prog: Program) -> Structure:
        """Streams, base compute times and the host's plan of a program; shared by every
        rank of a pipeline stage (their programs differ only in global ranks)."""
        key = ("template", prog.template) if prog.template is not None else ("rank", rank)
        out = self._structures.get(key)
        if out is None:
            gpu, cost, codes = self.job.cluster.gpu, self.cost, op_codes(prog)
            if not self.topo.shared_cpu:
                out = self._structures[key] = structure(
                    prog.ops, lambda op: cost.compute_time(op, gpu),
                    host_plan(prog.ops, cost, codes), codes)
                return out
            # ranks on CPU cores: the thread that computes pays for issuing the calls
            charges = thread_charges(prog.ops, cost)
            out = structure(prog.ops, lambda op: cost.compute_time(op, gpu),
                            host_plan(prog.ops, issue_cost(cost), codes), codes)
            for i, c in charges.items():
                out.base_s[i] += c.seconds
            out = self._structures[key] = out._replace(charged=charges)
        return out

    def structure_of(self, rank: int) -> Structure:
        """The stream structure of ``rank``'s program (see Structure)."""
        return self._structure(rank, self.programs[rank])

    def run(self) -> float:
        """Simulate; returns the step time in seconds. A private call that turns out to
        share its links with a flow (Contended) has the step simulated again with every
        call in the fabric."""
        try:
            return self._run()
        except Contended:
            progress, setup, structures = self.on_progress, self.on_setup, self._structures
            self.__init__(self.job, self.programs, self.cost, self.opt, self.classes)
            self.inline_private, self.on_progress, self.on_setup = False, progress, setup
            self._structures = structures
            return self._run()

    def _run(self) -> float:
        self.flows.prepare(self.programs)
        on = self.inline_private and not (self.opt.jitter or self.cost.overlap_slowdown
                                          or self.core_share or self.opt.degraded)
        self.inliner = Inliner.of(self.flows, self.fabric, self.simulated, on)
        done = ended(self.env)
        for k, (rank, prog) in enumerate(self.programs.items()):
            if self.on_setup:
                self.on_setup(k, len(self.programs))
            st = self._structure(rank, prog)
            ops = prog.ops
            walk, inline = walk_of(self.inliner, self._walks, rank, prog, st)
            evs = Events(inline, done)
            self._synced[rank] = {}
            for s, idx in walk.walks.items():
                if s == "p2p":  # each its own chain of callbacks
                    for i in idx:
                        SendRecv(self, rank, i, ops[i], evs, walk.external, st.host).go()
                else:
                    self.env.process(self._stream(rank, idx, evs, walk, st,
                                                  inline if s == COMPUTE else None))
        self.env.run()
        stuck = [k for k, rv in self._rv.items() if rv.members_left > 0]
        stuck += list(self._pairs)
        if stuck:
            raise RuntimeError(f"simulation ended with {len(stuck)} collectives or p2p waiting "
                               f"(first: {stuck[0]}): the schedule deadlocks")
        for rank, prog in self.programs.items():
            memory_times(prog.ops, self._structure(rank, prog), self.start[rank], self.end[rank])
            self.start[rank] = np.array(self.start[rank], dtype=float)
            self.end[rank] = np.array(self.end[rank], dtype=float)
        return max(float(e.max()) if len(e) else 0.0 for e in self.end.values())
