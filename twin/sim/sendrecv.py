"""Send/recv ops as chains of callbacks, without a SimPy process each: an op waits for its
dependencies, then for the host to issue it (past its sync point, at its issue time), then
for its peer; the pair's transfer runs its latency, then its flow (``transfer``).
Each step runs in the callback of the event it waited for, when a process would resume."""

from __future__ import annotations

from twin.schedule.ir import Op
from twin.sim.records import P2PPair, fire_op


class SendRecv:
    """One send or recv of ``rank``'s program (op ``i``) in a Simulation."""

    __slots__ = ("sim", "rank", "i", "op", "evs", "external", "host")

    def __init__(self, sim, rank: int, i: int, op: Op, evs: dict, external: set[int],
                 host=None):
        self.sim, self.rank, self.i, self.op = sim, rank, i, op
        self.evs, self.external, self.host = evs, external, host

    def _untriggered(self, ops_idx, ended: bool = False) -> list:
        """The events of ``ops_idx`` not triggered yet (``ended``: not processed yet, so that
        a collective's stream has recorded when it ended)."""
        sim, ops = self.sim, self.sim.programs[self.rank].ops
        return [ev for ev in (sim._event_of(self.rank, ops[d], self.evs, d) for d in ops_idx)
                if not (ev.processed if ended else ev.triggered)]

    def go(self) -> None:
        """Wait for the op's dependencies."""
        waits = self._untriggered(d for d in self.op.deps if d in self.external)
        if waits:
            _all(self.sim.env, waits).callbacks.append(self.issue)
        else:
            self.issue()

    def issue(self, _e=None) -> None:
        """Wait until the host has issued it: its sync point's ops ended, then its issue time."""
        host, env = self.host, self.sim.env
        if host is not None:
            i = self.i
            s = host.sync_of[i]
            ready = host.issue_s[i]
            if s >= 0:
                synced = self.sim._synced[self.rank]
                t_s = synced.get(s)
                if t_s is None:
                    waits = self._untriggered(host.waits[s], ended=True)
                    if waits:  # back here once they have ended (all_of even for one: it
                        # fires after the streams have recorded their ends)
                        env.all_of(waits).callbacks.append(self.issue)
                        self.sim.events += 1
                        return
                    t_s = synced[s] = self.sim._sync_time(self.rank, s, host)
                ready = max(ready, t_s + (host.issue_s[i] - host.issue_s[s]))
            if ready > env.now:
                env.timeout(ready - env.now).callbacks.append(self.arrive)
                return
        self.arrive()

    def arrive(self, _e=None) -> None:
        """Meet the peer; the second side starts the transfer. A folded peer is a copy of
        this rank, so it reaches its side of the pair when this rank reaches the same side
        of its own pair with the same tag (its mirror: a ring's recv for its send), and that
        one meets the mirror instead, each then starting its own transfer; a folded peer
        without a mirror is there already."""
        sim, op, rank = self.sim, self.op, self.rank
        src, dst = (rank, op.peer) if op.kind == "send" else (op.peer, rank)
        sim.start[rank][self.i] = sim.env.now
        folded = op.peer not in sim.simulated
        key = ("mirror", rank, op.tag) if folded and has_mirror(sim, rank, op) \
            else (src, dst, op.tag)
        pair = sim._pairs.get(key)
        if pair is None:
            pair = sim._pairs[key] = P2PPair([])
        pair.waiters.append((src, dst, op, self.done))
        if len(pair.waiters) == 2 or (folded and key[0] != "mirror"):
            del sim._pairs[key]
            if key[0] == "mirror":
                for s, d, o, w in pair.waiters:
                    transfer(sim, s, d, o, [w])
            else:
                transfer(sim, src, dst, op, [w for *_, w in pair.waiters])

    def done(self, _e) -> None:
        sim = self.sim
        sim.end[self.rank][self.i] = sim.env.now
        sim.events += 2
        if self.i in self.external:
            fire_op(self.evs, self.i)


def has_mirror(sim, rank: int, op: Op) -> bool:
    """Whether ``rank`` has the opposite side (recv for a send) of ``op``'s tag with a
    folded peer too (SendRecv.arrive)."""
    sides = sim._mirrors.get(rank)
    if sides is None:
        sides = sim._mirrors[rank] = {
            (o.kind, o.tag) for o in sim.programs[rank].ops
            if o.kind in ("send", "recv") and o.peer not in sim.simulated}
    return ("recv" if op.kind == "send" else "send", op.tag) in sides


def transfer(sim, src: int, dst: int, op: Op, waiters: list) -> None:
    """A pair's transfer by callbacks: its latency, then its flow, then ``waiters`` are
    called (by the fabric when the flow has moved, Fabric.transfer's ``then``, or at once
    when nothing moves)."""
    bundle, lat = sim.flows.p2p(src, dst, op.bytes)

    def moved() -> None:
        for w in waiters:
            w(None)

    def start(_e) -> None:
        if not sim._start(bundle, moved):
            moved()

    sim.env.timeout(lat * sim._noise(sim.cost.comm_cv)).callbacks.append(start)


def _all(env, events: list):
    return events[0] if len(events) == 1 else env.all_of(events)
