"""The critical path of a simulated step, as counts the cost model can re-time.

A step's time is the length of its critical path: from the op that ends last, back through
whatever each op waited for last (the previous op of its stream, a dependency, the last
member to reach a collective, the later side of a send/recv, or the host that issued it).
Along that path the step time is a sum: compute ops (each the cost model's time of its
kind, shape, FLOPs and bytes), the host's issue time up to the op it held back (counts of
issued ops per kind), collectives, transfers, and waits nothing on the path explains. Under
other cost parameters the same path re-times with a few hundred cost-model calls, so a fit
over a thousand runs evaluates in a fraction of a second; the path is found again by
simulating with the new parameters until it settles (``twin.calibrate.stepfit``). Every
simulation's summary reports the parts of its first step's path (``critical_path_s``).
"""

from __future__ import annotations

import dataclasses
from bisect import bisect_left
from collections import Counter
from dataclasses import dataclass, field

from twin.cost import CostModel, call_role
from twin.schedule.ir import Op
from twin.sim.codes import op_codes
from twin.spec import GPUSpec
from twin.vocab import COLLECTIVE_KINDS, P2P_KINDS

_COLLECTIVES = frozenset(COLLECTIVE_KINDS)
_CALLS = _COLLECTIVES | frozenset(P2P_KINDS)
"""Kinds whose ops are collectives or send/recvs (Op.is_collective or Op.is_p2p)."""


@dataclass
class CriticalPath:
    """One simulated step's critical path, aggregated by what its cost depends on."""

    step_s: float
    compute: Counter = field(default_factory=Counter)
    """Compute op (its kind, dtype, shape, FLOPs, bytes) -> times on the path."""
    host: Counter = field(default_factory=Counter)
    """``KIND:DTYPE`` of a compute op -> ops the host issued before the op it held back
    ('comm@ROLE' for collectives and send/recv, 'comm_ranks' the collectives' group members,
    'tp_gemm' the GEMMs that pay host_tp_gemm_us),
    each in its kind and dtype's units (``host_weight``, priced by ``host_us``)."""
    comm_s: float = 0.0
    """Collectives on the path (measured fits: fixed while compute and host are fitted)."""
    p2p_s: float = 0.0
    """Send/recv transfers on the path, latency included."""
    p2p_n: int = 0
    """Send/recv transfers on the path (each pays the p2p latency)."""
    p2p_latency_s: float = 0.0
    """The p2p latency ``p2p_s`` was timed with."""
    other_s: float = 0.0
    """Waits on the path that none of the above explains."""
    overlap_s: float = 0.0
    """What compute on the path took past its kernels' time beside collectives of its rank
    (``overlap_slowdown``: twin/sim/overlap.py; fixed while compute and host are fitted)."""
    period: object = None
    """With ``critical_path(window=...)``: what one period of the window adds (its ``path``;
    ``exact`` False when an op spans the whole period)."""

    def plus(self, other: CriticalPath, n: int) -> CriticalPath:
        """This path with ``n`` times ``other`` added (periods of a fast-forwarded steady
        state: twin/sim/fastforward.py)."""
        out = CriticalPath(self.step_s + n * other.step_s, Counter(self.compute),
                           Counter(self.host), self.comm_s + n * other.comm_s,
                           self.p2p_s + n * other.p2p_s, self.p2p_n + n * other.p2p_n,
                           self.p2p_latency_s, self.other_s + n * other.other_s,
                           overlap_s=self.overlap_s + n * other.overlap_s)
        for mine, more in ((out.compute, other.compute), (out.host, other.host)):
            for key, count in more.items():
                mine[key] += n * count
        return out

    def retime(self, cost: CostModel, gpu: GPUSpec, p2p_latency_s: float | None = None) -> float:
        """The path's length under ``cost`` (the path itself unchanged)."""
        t = sum(n * cost.compute_time(op, gpu) for op, n in self.compute.items())
        for kind, n in self.host.items():
            t += n * host_us(cost, kind) * 1e-6
        lat = self.p2p_latency_s if p2p_latency_s is None else p2p_latency_s
        return t + self.comm_s + self.p2p_s + self.p2p_n * (lat - self.p2p_latency_s) \
            + self.other_s + self.overlap_s

    def parts(self, cost: CostModel, gpu: GPUSpec) -> dict[str, float]:
        """Seconds of the path per mechanism: compute per kind, host, collectives, p2p, other,
        and compute slowed beside collectives (overlap)."""
        out: dict[str, float] = {}
        for op, n in self.compute.items():
            out[op.kind] = out.get(op.kind, 0.0) + n * cost.compute_time(op, gpu)
        host = sum(n * host_us(cost, k) for k, n in self.host.items()) * 1e-6
        out.update(host=host, collectives=self.comm_s, p2p=self.p2p_s, other=self.other_s,
                   overlap=self.overlap_s)
        return out

    def shape_factor_s(self, cost: CostModel, gpu: GPUSpec) -> float:
        """Seconds the profile's kernel shape factors add to the path (negative: they take
        time off): its compute under ``cost`` minus under ``cost`` without them."""
        if not cost.shape_factors:
            return 0.0
        smooth = dataclasses.replace(cost, shape_factors={})
        return sum(n * (cost.compute_time(op, gpu) - smooth.compute_time(op, gpu))
                   for op, n in self.compute.items())


def host_us(cost: CostModel, kind: str, dtype: str = "") -> float:
    """The host's microseconds per count of ``kind`` in ``CriticalPath.host``: a compute op's
    ``KIND:DTYPE`` is priced by its own dtype's kernel (``dtype`` where it names none)."""
    if kind.startswith("comm@"):  # a call on a group of that role
        return cost.comm_host_us(kind[5:])
    if kind == "comm_ranks":
        return cost.host_comm_per_rank_us
    if kind == "tp_gemm":
        return cost.host_tp_gemm_us
    kind, _, own = kind.partition(":")
    return cost.kernel(kind, own or dtype).host_us


def host_weight(cost: CostModel, op: Op) -> float:
    """``op``'s host time in its kind and dtype's units (``CriticalPath.host`` counts them): 1,
    but for an elementwise op the eager factor prices apart (a one-kernel copy, an op outside
    the compiled blocks: CostModel.kernel_of)."""
    if op.kind != "elementwise":
        return 1.0
    unit = cost.kernel(op.kind, op.dtype).host_us
    return cost.kernel_of(op).host_us / unit if unit else 1.0


def signature(op: Op) -> Op:
    """The op as a compute signature: what its cost depends on, nothing else."""
    key = (op.kind, op.dtype, tuple(op.shape), float(op.flops), float(op.bytes))
    sig = _SIGNATURES.get(key)
    if sig is None:  # the same few recur on every path and in every kind count
        if len(_SIGNATURES) >= 1 << 16:
            _SIGNATURES.clear()
        sig = _SIGNATURES[key] = Op(name="", kind=key[0], stream="compute", dtype=key[1],
                                    shape=key[2], flops=key[3], bytes=key[4])
    return sig


_SIGNATURES: dict[tuple, Op] = {}


def _before(st, op: Op, i: int) -> int | None:
    """The op before op ``i`` on its stream (None: the first, or a memory op)."""
    idx = st.streams.get(op.stream)
    k = bisect_left(idx, i) if idx else 0
    return idx[k - 1] if k else None


class _Calls:
    """Who takes part in the collectives and send/recvs of a finished simulation: the
    simulated members of a collective's group (the engine's rendezvous waits for them), the
    two sides of a send/recv. A rank's calls are indexed when the walk first needs them."""

    def __init__(self, programs: dict):
        self.programs = programs
        self._order = {r: k for k, r in enumerate(programs)}
        self._index: dict[int, dict] = {}

    def _of(self, rank: int) -> dict:
        """Collective name, or (send|recv, peer, tag) -> the op's index in ``rank``'s program."""
        index = self._index.get(rank)
        if index is None:
            index = self._index[rank] = {}
            prog = self.programs[rank]
            ops = prog.ops
            for k in op_codes(prog).where(lambda op: op.kind in _CALLS):
                op = ops[k]
                index[op.name if op.kind in _COLLECTIVES else (op.kind, op.peer, op.tag)] = k
                if op.kind not in _COLLECTIVES and op.peer not in self._order:
                    index[("mirror", op.kind, op.tag)] = k  # (twin.sim.sendrecv)
        return index

    def members(self, rank: int, op: Op) -> list[tuple[int, int]]:
        """(rank, op index) of each simulated op of the call ``rank``'s ``op`` is part of,
        in rank order."""
        found = []
        if op.kind in _COLLECTIVES:
            for m in op.group:
                k = self._of(m).get(op.name) if m in self._order else None
                if k is not None and self.programs[m].ops[k].group == op.group:
                    found.append((m, k))
        else:
            src, dst = (rank, op.peer) if op.kind == "send" else (op.peer, rank)
            for m, side in ((src, ("send", dst, op.tag)), (dst, ("recv", src, op.tag))):
                k = self._of(m).get(side) if m in self._order else None
                if k is None and m == op.peer:  # a folded peer: this rank's mirror side
                    m, k = rank, self._of(rank).get(("mirror", side[0], op.tag))
                if k is not None:
                    found.append((m, k))
        return sorted(found, key=lambda m: (self._order[m[0]], m[1]))


class _Window:
    """What one period [lo, hi) of a repeating steady state adds to a path (fast-forward):
    the pieces of the walk (an op, a wait) that end inside it; a wait or transfer spanning it
    whole grows by the period's length."""

    def __init__(self, lo: float, hi: float, p2p_latency_s: float):
        self.lo, self.hi = lo, hi
        self.path = CriticalPath(step_s=hi - lo, p2p_latency_s=p2p_latency_s)
        self.exact = True
        """False when a counted piece (an op, the host's issues) spans the whole period."""

    def add(self, a: float, b: float, field: str = "", seconds: float = 0.0, counter=None,
            key=None, n: int = 1) -> None:
        p = self.path
        if self.lo <= b < self.hi:
            if counter is not None:
                getattr(p, counter)[key] += n
            elif field:
                setattr(p, field, getattr(p, field) + seconds)
                if field == "p2p_s":
                    p.p2p_n += 1
        elif a < self.lo and b >= self.hi:
            if counter is not None:
                self.exact = False
            elif field and field != "overlap_s":  # (an op: its counter marks the period)
                setattr(p, field, getattr(p, field) + (self.hi - self.lo))


def critical_path(sim, p2p_latency_s: float = 0.0,
                  window: tuple[float, float] | None = None) -> CriticalPath:
    """The critical path of a finished ``twin.sim.engine.Simulation`` (see the module
    docstring). ``p2p_latency_s``: the latency each send/recv was timed with. ``window``
    (lo, hi): one period of a repeating steady state; ``path.period`` is then what each
    period adds to the path (twin/sim/fastforward.py inserts more of them)."""
    ends = {r: e for r, e in sim.end.items() if len(e)}
    rank = max(ends, key=lambda r: float(ends[r].max()))
    i = int(ends[rank].argmax())
    path = CriticalPath(step_s=float(ends[rank][i]), p2p_latency_s=p2p_latency_s)
    win = _Window(*window, p2p_latency_s) if window else None
    add = win.add if win else (lambda *a, **k: None)
    if win:
        path.period = win
    calls = _Calls(sim.programs)
    t = path.step_s
    seen: set[tuple[int, int]] = set()

    def call(begin: float) -> None:  # the call on the path, from ``begin`` to ``t``
        took = max(0.0, t - begin)
        if op.is_p2p:
            path.p2p_s += took
            path.p2p_n += 1
            add(begin, t, "p2p_s", took)
        else:
            path.comm_s += took
            add(begin, t, "comm_s", took)

    for _ in range(4 * sum(len(p.ops) for p in sim.programs.values()) + 16):
        op = sim.programs[rank].ops[i]
        seen.add((rank, i))
        is_call = op.kind in _CALLS
        if is_call:  # the member that reached it last
            rank, i = max(calls.members(rank, op), key=lambda m: float(sim.start[m[0]][m[1]]))
            op = sim.programs[rank].ops[i]
            ready = float(sim.start[rank][i])
        else:
            ready = float(sim.start[rank][i])
            if op.is_compute:
                done = float(sim.end[rank][i])
                sig = signature(op)
                path.compute[sig] += 1
                add(ready, done, counter="compute", key=sig)
                slowed = sim.slowed_s(rank, i)
                if slowed:
                    path.overlap_s += slowed
                    add(ready, done, "overlap_s", slowed)
                c = sim.structure_of(rank).charged.get(i)
                if c is not None:  # its thread issued calls first (ranks on CPU cores)
                    for kind, n in (*((f"comm@{r}", k) for r, k in c.calls), ("comm_ranks", c.members),
                                    ("tp_gemm", int(c.tp_gemm))):
                        path.host[kind] += n
                        add(ready, done, counter="host", key=kind, n=n)
                path.other_s += max(0.0, t - done)
                add(done, t, "other_s", max(0.0, t - done))
        end = sim.end[rank]
        cands = [(float(end[d]), 1, d) for d in op.deps]
        st = sim.structure_of(rank)
        j = _before(st, op, i)
        if j is not None:
            cands.append((float(end[j]), 1, j))
        host = st.host
        sync = -1
        if host is not None:
            cands.append((host.issue_s[i], 0, -1))  # issued from the step's start
            sync = host.sync_of[i]
            if sync >= 0:  # or from the host's last wait for the device
                w = max(host.waits[sync], key=lambda k: float(end[k]))
                cands.append((float(end[w]) + host.offset_s(i), 0, w))
        seen.add((rank, i))
        # ties (zero-time ops, a host released at the instant a transfer ends) must not
        # lead back to an op already on the path
        cands = [c for c in cands if c[2] < 0 or (rank, c[2]) not in seen]
        if not cands:
            if is_call:
                call(ready)
            path.other_s += max(0.0, ready)
            add(0.0, ready, "other_s", max(0.0, ready))
            return path
        when, is_op, j = max(cands)
        if is_call:  # a send/recv posted in a batch before the op it waits for has ended
            call(max(ready, when))  # runs from then: the path's time counted once
        path.other_s += max(0.0, ready - when)
        add(when, ready, "other_s", max(0.0, ready - when))
        if not is_op:  # the host held it back: count what it issued up to this op
            first = sync + 1 if j >= 0 else 0
            issued = when
            when = float(end[j]) if j >= 0 else 0.0
            for o in sim.programs[rank].ops[first: i + 1]:
                kind = f"{o.kind}:{o.dtype}" if o.is_compute else f"comm@{call_role(o)}" \
                    if o.is_collective or o.is_p2p else ""
                if kind:
                    w = host_weight(sim.cost, o)
                    path.host[kind] += w
                    add(when, issued, counter="host", key=kind, n=w)
                if o.is_collective:
                    path.host["comm_ranks"] += len(o.group)
                    add(when, issued, counter="host", key="comm_ranks", n=len(o.group))
                elif o.tp_gemm:
                    path.host["tp_gemm"] += 1
                    add(when, issued, counter="host", key="tp_gemm", n=1)
            if j < 0:
                return path
        i, t = j, when
    raise RuntimeError("the critical path does not end: the trace has a cycle")
