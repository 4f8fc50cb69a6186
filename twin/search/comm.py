"""Closed-form collective and send/recv times, planned as the twin plans them.

A collective over a group is split into the twin's own phases (``twin.sim.collectives.
plan_collective``: ring, or hierarchical across nodes) on the twin's topology, and timed
without running the engine: every group of the same axis runs the same collective at the
same moment, so a phase moves its bytes at the pace of its most loaded link, counting the
flows of every sibling group that crosses it (by symmetry, the links of node 0):

    t(S) = base latency + sum_k (latency_k + S * max_links(load_k(link) / capacity(link)))

with load_k per byte of S (the twin's rate law in ``twin.sim.flows.FlowPlanner``). A measured
fit of the profile (``CostModel.collective_fit``) replaces it with latency + S / bw, as the
twin does. The time is affine in S, so each (kind, axis, grid) is planned once and cached,
its seconds per byte split by the links that bound each phase (inside a node, or the
network): two collectives running at once on other streams share those links, so together
they take at least the larger of their times and of each link class's summed load
(``together_s``). Traffic of other axes is not counted otherwise (the simulator does).
"""

from __future__ import annotations

from collections import defaultdict

from twin.cost import CostModel
from twin.sim.collectives import plan_collective
from twin.sim.topology import Topology
from twin.spec import Job
from twin.spec.experts import expert_grid

Affine = tuple[float, float]
"""(seconds, seconds per byte): t(S) = a + b * S."""
Split = tuple[float, float, float]
"""(seconds, seconds per byte on links inside a node, on the network): b = b_intra + b_inter."""
NETWORK = ("nic_out", "nic_in", "up", "down")
EXPERT_DIMS = ("ep", "etp", "edp")
"""Groups of the expert grid (``twin.spec.experts``), not axes of the rank grid."""


def together_s(*parts: tuple[Split, float], tp=None) -> float:
    """Collectives (each a Split and its bytes S) running at the same time on their own
    streams: at least each one's own time and each link class's load summed over them
    (and over the unit's own collectives, ``tp``: a ``twin.search.units.Timing``)."""
    alone = max((a + s * (bi + be) for (a, bi, be), s in parts), default=0.0)
    intra = sum(s * bi for (_, bi, _), s in parts) + (tp.intra_s if tp else 0.0)
    inter = sum(s * be for (_, _, be), s in parts) + (tp.inter_s if tp else 0.0)
    return max(alone, intra, inter)


def _node(res: tuple, gpn: int) -> int:
    return res[1] // gpn if res[0] in ("out", "in") else res[1]


class CommModel:
    """Collective and p2p times of jobs on one cluster family under one cost profile."""

    def __init__(self, cost: CostModel):
        self.cost = cost
        self._affine: dict[tuple, Split] = {}
        self._p2p: dict[tuple, list[Affine]] = {}

    def _topology(self, job: Job) -> tuple[Topology, dict]:
        topo = Topology(job.cluster, job.grid, self.cost)
        gpn = job.grid.gpus_per_node
        cap = topo.resources_for(range(min(gpn, job.grid.world_size)))
        return topo, cap

    def _loads_s(self, flows, topo: Topology, cap: dict, nodes: set[int]) -> tuple[float, bool]:
        """Seconds per byte of a phase (its most loaded link among ``nodes``' links) and
        whether that link is the network's."""
        load: dict[tuple, float] = defaultdict(float)
        for src, dst, nbytes in flows:
            for res in topo.route(src, dst):
                load[res] += nbytes
        gpn = topo.gpn
        worst, net = 0.0, False
        for res, amount in load.items():
            if _node(res, gpn) in nodes:
                t = amount * topo.byte_cost(res) / cap[res]
                if t > worst:
                    worst, net = t, res[0] in NETWORK
        return worst, net

    def split(self, job: Job, kind: str, dims: str, role: str | None = None) -> Split:
        """(a, b_intra, b_inter) of one collective of ``kind`` over the ``dims`` group (e.g.
        'dp', 'tp-pp')."""
        grid, par = job.grid, job.parallel
        key = (kind, dims, role, grid.order, grid.sizes, grid.dp_shard, grid.gpus_per_node,
               job.cluster.name, (par.ep, par.expert_tp) if dims in EXPERT_DIMS else None)
        hit = self._affine.get(key)
        if hit is not None:
            return hit
        gpn = grid.gpus_per_node
        # rank 0's group first, then the sibling groups of the axis that touch node 0
        of = expert_grid(grid, par).group if dims in EXPERT_DIMS else grid.group
        groups = list(dict.fromkeys(of(r, dims) for r in range(min(gpn, grid.world_size))))
        self._affine[key] = out = self._plan(job, kind, groups, role or dims)
        return out

    def affine(self, job: Job, kind: str, dims: str, role: str | None = None) -> Affine:
        """(a, b) of one collective of ``kind`` over the ``dims`` group."""
        a, bi, be = self.split(job, kind, dims, role)
        return a, bi + be

    def pair_affine(self, job: Job, kind: str, pairs: list[tuple[int, ...]], role: str) -> Affine:
        """(a, b) of a collective over explicit groups running together (the first timed)."""
        key = (kind, tuple(pairs), role, job.grid.order, job.grid.sizes, job.cluster.name)
        hit = self._affine.get(key)
        if hit is None:
            hit = self._affine[key] = self._plan(job, kind, pairs, role)
        return hit[0], hit[1] + hit[2]

    def _plan(self, job: Job, kind: str, groups: list[tuple[int, ...]], role: str) -> Split:
        group = groups[0]
        if len(group) <= 1:
            return 0.0, 0.0, 0.0
        grid, cost = job.grid, self.cost
        link = "inter" if grid.nodes_spanned(group) > 1 else "intra"
        fit = cost.collective_fit(kind, link, len(group), role)
        if fit is not None:
            per_byte = 1.0 / (fit["bw_GBps"] * 1e9)
            return fit["latency_us"] * 1e-6, *((0.0, per_byte) if link == "inter"
                                               else (per_byte, 0.0))
        topo, cap = self._topology(job)
        phases = [plan_collective(kind, g, 1.0, topo) for g in groups]
        a = cost.base_latency_us * 1e-6 + sum(p.latency_s for p in phases[0])
        bi = be = 0.0
        for k in range(len(phases[0])):
            flows = [f for ph in phases if k < len(ph) for f in ph[k].flows]
            b, net = self._loads_s(flows, topo, cap, {0})
            if net:
                be += b
            else:
                bi += b
        return a, bi, be

    def collective_s(self, job: Job, kind: str, dims: str, nbytes: float,
                     role: str | None = None) -> float:
        a, bi, be = self.split(job, kind, dims, role)
        return a + (bi + be) * nbytes

    def p2p(self, job: Job) -> list[Affine]:
        """(a, b) of the send/recv from each pipeline stage to the next (the last to the
        first, for interleaved chunks), every rank of the stage sending at once."""
        grid, cost = job.grid, self.cost
        key = (grid.order, grid.sizes, grid.gpus_per_node, job.cluster.name)
        hit = self._p2p.get(key)
        if hit is not None:
            return hit
        topo, _ = self._topology(job)
        p, gpn = grid.size("pp"), grid.gpus_per_node
        out = []
        for s in range(p):
            src, dst = grid.rank(pp=s), grid.rank(pp=(s + 1) % p)
            link = "inter" if topo.inter(src, dst) else "intra"
            fit = cost.collective_fit("sendrecv", link, 2)
            lat = cost.p2p_latency_us * 1e-6 if cost.p2p_latency_us is not None \
                else topo.alpha(src, dst)
            if fit is not None:
                out.append((fit["latency_us"] * 1e-6, 1.0 / (fit["bw_GBps"] * 1e9)))
                continue
            node = grid.node(src)
            senders = [r for r in range(node * gpn, min((node + 1) * gpn, grid.world_size))
                       if grid.coord(r, "pp") == s]
            flows = [(r, _shift(grid, r, (s + 1) % p), 1.0) for r in senders]
            cap = topo.resources_for({*senders, *(f[1] for f in flows)})
            out.append((lat, self._loads_s(flows, topo, cap, {grid.node(src), grid.node(dst)})[0]))
        self._p2p[key] = out
        return out


    def shift(self, job: Job, dim: str) -> Affine:
        """(a, b) of a send/recv from each rank to the next along ``dim`` (CP's ring), every
        rank of node 0 sending at once (their flows share the links)."""
        grid, cost = job.grid, self.cost
        key = ("shift", dim, grid.order, grid.sizes, grid.gpus_per_node, job.cluster.name)
        hit = self._p2p.get(key)
        if hit is not None:
            return hit[0]
        topo, _ = self._topology(job)
        n, gpn = grid.size(dim), grid.gpus_per_node
        senders = range(min(gpn, grid.world_size))
        flows = [(r, _shift(grid, r, (grid.coord(r, dim) + 1) % n, dim), 1.0) for r in senders]
        inter = any(topo.inter(a, b) for a, b, _ in flows)
        fit = cost.collective_fit("sendrecv", "inter" if inter else "intra", 2)
        if fit is not None:
            out = (fit["latency_us"] * 1e-6, 1.0 / (fit["bw_GBps"] * 1e9))
        else:
            lat = cost.p2p_latency_us * 1e-6 if cost.p2p_latency_us is not None \
                else max(topo.alpha(a, b) for a, b, _ in flows)
            cap = topo.resources_for({*senders, *(f[1] for f in flows)})
            nodes = {grid.node(r) for f in flows for r in f[:2]}
            out = (lat, self._loads_s(flows, topo, cap, nodes)[0])
        self._p2p[key] = [out]
        return out


def _shift(grid, rank: int, stage: int, dim: str = "pp") -> int:
    coords = grid.coords(rank)
    coords[dim] = stage
    return grid.rank(**coords)

