"""A simulated collective call: the rendezvous of its simulated members, then its phases
(a latency, then the phase's bundled flow through the fabric) run by callbacks; part of
twin/sim/engine.py's Simulation."""

from __future__ import annotations

import simpy

from twin.schedule.ir import Op
from twin.sim.records import Bundle, Rendezvous


class Calls:
    """Simulation's collective calls (the engine's state: env, fabric, flows, _rv, ...)."""

    def _start(self, b: Bundle | None, then) -> bool:
        """Start bundle ``b``'s flow, ``then()`` called when it has moved; False: nothing
        moves (``then`` not called)."""
        if b is None:
            return False
        return self.fabric.transfer(b.resources, b.size_bytes, weights=b.weights,
                                    costs=b.byte_costs, then=then)

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
            if self.cost.busy_handoff_us and self._cores_busy(op.group):
                base += self.cost.busy_handoff_us * 1e-6
            self._next_phase(bundles, lats, 0, rv.done, self._noise(self.cost.comm_cv), base)
            if self.on_progress and len(op.group) >= 1024:
                self.on_progress(self.ops_done)  # planning a large group takes a while: say so
        self.events += 1
        return rv.done

    def _cores_busy(self, group: tuple[int, ...]) -> bool:
        """Whether the cores of a node of ``group`` all compute (ranks on shared CPU cores:
        the call's thread then waits for a time slice, CostModel.busy_handoff_us)."""
        if not self.core_share:
            return False
        cap = self.fabric.capacity
        nodes = {self.job.grid.node(m) for m in group}
        return any(self.computing.get(n, 0.0) >= cap[("cpu", n)] - 1e-9 for n in nodes)

    def _next_phase(self, specs: list[Bundle | None], lats: list[float], k: int,
                    done: simpy.Event, noise: float, extra: float) -> None:
        """Run phase k (latency, then its bundled flow) by callbacks, then the next."""
        if k == len(specs):
            done.succeed()
            return
        lat = (lats[k] + extra) * noise

        def start(_=None):
            self.events += 2

            def moved() -> None:
                self._next_phase(specs, lats, k + 1, done, noise, 0.0)

            if not self._start(specs[k], moved):
                moved()

        if lat > 0:
            self.env.timeout(lat).callbacks.append(start)
        else:
            start()

    def _event_of(self, rank: int, op: Op, evs, i: int) -> simpy.Event:
        """The completion event of op ``i`` (a collective's is its rendezvous event unless
        the compute walk times it), made on first use (records.Events)."""
        ev = evs.get(i)
        if ev is None:
            ev = evs[i] = self._rendezvous(op).done if op.is_collective and i not in evs.inline \
                else self.env.event()
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
