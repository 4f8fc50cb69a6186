"""Collective algorithms as phases of point-to-point flows over the topology.

Each phase is a latency and a set of transfers (src, dst, bytes); a phase ends when its
slowest flow ends, so topology and contention shape the collective's time. Byte counts
per rank follow nccl-tests' bus-bandwidth factors (PERFORMANCE.md):

- ring all-reduce: every member sends 2(n-1)/n * S to its ring successor, 2(n-1) steps;
  all-gather and reduce-scatter (n-1)/n * S in n-1 steps; broadcast and reduce S along a
  pipelined chain; gather and scatter S/n between the root and each member; all-to-all
  S/n from every member to every other.
- tree all-reduce (NCCL's double binary tree): each rank sends and receives about 2 * S
  over the two complementary trees, 2 * ceil(log2 n) steps.
- hierarchical (a group over several nodes with g members on each): intra-node
  reduce-scatter ((g-1)/g * S), inter-node ring among same-position members on S/g
  (all-reduce 2(N-1)/N, all-gather or reduce-scatter (N-1)/N), intra-node all-gather.
Latency per phase (NCCL's model, published.md §5.3): base + steps over intra-node hops
x alpha_intra + steps over inter-node hops x alpha_inter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

from twin.sim.topology import Topology


class Transfer(NamedTuple):
    """One point-to-point flow of a phase: ``src`` sends ``size_bytes`` to ``dst``."""

    src: int
    dst: int
    size_bytes: float


@dataclass(slots=True)
class Phase:
    """One step of a collective: a latency, then its transfers; it ends with the slowest."""

    latency_s: float
    flows: list[Transfer]


def _ring_latency(topo: Topology, members: tuple[int, ...], steps: int) -> float:
    n = len(members)
    inter_hops = sum(topo.inter(members[i], members[(i + 1) % n]) for i in range(n))
    if inter_hops:
        # as NCCL: the steps that cross nodes pay the network latency
        nodes = len({topo.grid.node(r) for r in members})
        inter_steps = steps * (nodes - 1) // max(n - 1, 1) if n > 1 else 0
        inter_steps = max(inter_steps, 1)
        a_intra, a_inter = topo.alpha(members[0], members[0]), topo.cost.link_latency_s(
            topo.cluster, True)
        return (steps - inter_steps) * a_intra + inter_steps * a_inter
    return steps * topo.alpha(members[0], members[-1])


def ring(kind: str, members: tuple[int, ...], nbytes: float, topo: Topology,
         root: int = -1) -> list[Phase]:
    """The ring (or chain, or star) form of a collective over ``members`` in order."""
    n = len(members)
    nxt = {members[i]: members[(i + 1) % n] for i in range(n)}
    if kind == "all_reduce":
        w, steps = 2 * (n - 1) / n * nbytes, 2 * (n - 1)
        return [Phase(_ring_latency(topo, members, steps), [Transfer(m, nxt[m], w) for m in members])]
    if kind in ("all_gather", "reduce_scatter"):
        w, steps = (n - 1) / n * nbytes, n - 1
        return [Phase(_ring_latency(topo, members, steps), [Transfer(m, nxt[m], w) for m in members])]
    if kind in ("broadcast", "reduce"):
        # pipelined chain starting (broadcast) or ending (reduce) at the root
        start = members.index(root) if root in members else 0
        chain = members[start:] + members[:start]
        if kind == "reduce":
            chain = chain[1:] + chain[:1]
        flows = [Transfer(chain[i], chain[i + 1], nbytes) for i in range(n - 1)]
        return [Phase(_ring_latency(topo, chain, n - 1), flows)]
    if kind in ("gather", "scatter"):
        r = root if root in members else members[0]
        flows = [(Transfer(m, r, nbytes / n) if kind == "gather" else Transfer(r, m, nbytes / n))
                 for m in members if m != r]
        return [Phase(max(topo.alpha(r, m) for m in members), flows)]
    if kind == "all_to_all":
        flows = [Transfer(a, b, nbytes / n) for a in members for b in members if a != b]
        return [Phase(max(topo.alpha(members[0], m) for m in members), flows)]
    raise ValueError(f"no algorithm for collective kind {kind!r}")


def tree(kind: str, members: tuple[int, ...], nbytes: float, topo: Topology) -> list[Phase]:
    """Double binary tree all-reduce (other kinds fall back to the ring)."""
    if kind != "all_reduce":
        return ring(kind, members, nbytes, topo)
    n = len(members)
    depth = math.ceil(math.log2(n)) if n > 1 else 0
    # NCCL's two trees are complementary (a rank internal in one is a leaf in the other), so
    # each rank sends and receives about 2S in all: a balanced pattern of 2S per member
    flows = [Transfer(members[i], members[(i + 1) % n], 2 * nbytes) for i in range(n)]
    inter = any(topo.inter(a, b) for a, b, _ in flows)
    alpha = topo.cost.link_latency_s(topo.cluster, inter)
    return [Phase(2 * depth * alpha, flows)]


def hierarchical(kind: str, members: tuple[int, ...], nbytes: float,
                 topo: Topology) -> list[Phase] | None:
    """Intra-node, then inter-node on 1/g of the data, then intra-node; None if the
    group is not spread evenly over several nodes."""
    by_node: dict[int, list[int]] = {}
    for m in members:
        by_node.setdefault(topo.grid.node(m), []).append(m)
    nodes = list(by_node.values())
    g, N = len(nodes[0]), len(nodes)
    if N < 2 or g < 2 or any(len(x) != g for x in nodes) or \
            kind not in ("all_reduce", "all_gather", "reduce_scatter"):
        return None
    phases: list[Phase] = []
    if kind in ("all_reduce", "reduce_scatter"):
        flows = [f for local in nodes for f in ring("reduce_scatter", tuple(local), nbytes, topo)[0].flows]
        phases.append(Phase(_ring_latency(topo, tuple(nodes[0]), g - 1), flows))
    inter_kind = kind
    flows = []
    for pos in range(g):
        rail = tuple(local[pos] for local in nodes)
        flows += ring(inter_kind, rail, nbytes / g, topo)[0].flows
    rail0 = tuple(local[0] for local in nodes)
    steps = 2 * (N - 1) if kind == "all_reduce" else N - 1
    phases.append(Phase(_ring_latency(topo, rail0, steps), flows))
    if kind in ("all_reduce", "all_gather"):
        flows = [f for local in nodes for f in ring("all_gather", tuple(local), nbytes, topo)[0].flows]
        phases.append(Phase(_ring_latency(topo, tuple(nodes[0]), g - 1), flows))
    return phases


def plan_collective(kind: str, members: tuple[int, ...], nbytes: float, topo: Topology,
                    algorithm: str = "auto", root: int = -1) -> list[Phase]:
    """The phases of one collective; ``auto``: hierarchical across nodes, else ring."""
    if len(members) <= 1:
        return []
    if algorithm in ("auto", "hierarchical"):
        phases = hierarchical(kind, members, nbytes, topo)
        if phases is not None:
            return phases
    if algorithm == "tree":
        return tree(kind, members, nbytes, topo)
    return ring(kind, members, nbytes, topo, root)
