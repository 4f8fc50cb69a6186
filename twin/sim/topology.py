"""Topology: the cluster's links as fabric resources, and the route between two ranks.

- NVSwitch / PCIe node: each device has an out-port and an in-port at the intra-node
  bandwidth (per device per direction); a transfer inside the node crosses the
  sender's out-port and the receiver's in-port.
- shared_cpu (``cpu_local``): ranks are processes on one host; gloo moves bytes with the
  host's cores, so a transfer and compute share one resource ("cpu", node): a byte costs
  1 / (intra bandwidth) core-seconds, a second of compute one core-second. Compute
  slows while communication runs beside it, and communication slows under compute.
- Between nodes: the NIC of the sender's rail (local rank * nics / gpus_per_node) out,
  the receiver's NIC in; with a fat tree oversubscribed k:1 a node's uplink and downlink
  carry nics * nic_bw / k; rail-optimized fabrics keep same-rail traffic off the spine.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from twin.cost import CostModel
from twin.spec import ClusterSpec, RankGrid

Resource = tuple
"""A fabric resource: its kind, then the indices RESOURCE_INDICES names, e.g.
("nic_out", 0, 3) is node 0's NIC 3 outbound. A plain tuple: the fabric's dict key."""

RESOURCE_INDICES: dict[str, tuple[str, ...]] = {
    "nic_out": ("node", "NIC"), "nic_in": ("node", "NIC"), "up": ("node",), "down": ("node",),
    "out": ("rank",), "in": ("rank",), "cpu": ("node",)}
"""Each resource kind and what its indices are (which kinds a cluster has: resources_for)."""


@dataclass
class Topology:
    """The cluster's links and shared cores as named fabric resources, and routes over them."""

    cluster: ClusterSpec
    grid: RankGrid
    cost: CostModel
    degraded: dict[Resource, float] | None = None
    """Resource -> bandwidth factor (what-if: a degraded link)."""
    gpn: int = field(init=False)
    """Devices (ranks) per node."""
    shared_cpu: bool = field(init=False)
    """Ranks are processes on one host sharing its cores (the "cpu" resource)."""
    nics: int = field(init=False)
    """NICs per node."""
    intra_Bps: float = field(init=False)
    """Effective intra-node bandwidth per device per direction, bytes/s."""
    nic_Bps: float = field(init=False)
    """Effective bandwidth per NIC per direction, bytes/s."""
    oversub: float = field(init=False)
    """Fat-tree oversubscription k (k:1)."""
    rail: bool = field(init=False)
    """Rail-optimized fabric: same-rail traffic stays off the spine."""
    capacity: dict[Resource, float] = field(init=False)
    """Resource -> units per second (bytes/s; cores for "cpu"), filled by resources_for."""

    def __post_init__(self) -> None:
        c = self.cluster
        self.gpn = c.gpus_per_node
        self.shared_cpu = c.intra.kind == "shared_cpu"
        self.nics = c.inter.nics_per_node
        self.intra_Bps = c.intra.bw_GBps * 1e9 * self.cost.intra.bw_efficiency
        self.nic_Bps = c.inter.nic_bw_GBps * 1e9 * self.cost.inter.bw_efficiency
        self.oversub = c.inter.oversubscription
        self.rail = c.inter.topology == "rail_optimized"
        self.capacity = {}

    def resources_for(self, ranks) -> dict[Resource, float]:
        """Capacities of the resources the given ranks can touch (created on demand)."""
        gpn = self.gpn
        if isinstance(ranks, range) and ranks.step == 1:  # every rank: no walk for the nodes
            nodes = range(ranks.start // gpn, -(-ranks.stop // gpn)) if ranks else range(0)
        else:
            nodes = sorted({r // gpn for r in ranks})
        cap = self.capacity
        nic, up = self.nic_Bps, self.nics * self.nic_Bps / self.oversub
        if self.shared_cpu:
            cores = float(self.cost.cores_effective or self.cluster.cores_per_node or gpn)
            cap.update({("cpu", n): cores for n in nodes})
        for i in range(self.nics):
            cap.update({("nic_out", n, i): nic for n in nodes})
            cap.update({("nic_in", n, i): nic for n in nodes})
        cap.update({("up", n): up for n in nodes})
        cap.update({("down", n): up for n in nodes})
        if not self.shared_cpu:
            intra = self.intra_Bps
            cap.update({("out", r): intra for r in ranks})
            cap.update({("in", r): intra for r in ranks})
        for res, factor in (self.degraded or {}).items():
            if res in cap:
                cap[res] = cap[res] * factor
        return cap

    def nic(self, rank: int) -> int:
        return self.grid.local_rank(rank) * self.nics // self.gpn

    def inter(self, a: int, b: int) -> bool:
        return a // self.gpn != b // self.gpn  # grid.node without its range check: hot path

    def route(self, src: int, dst: int) -> tuple[Resource, ...]:
        """Resources a transfer from ``src`` to ``dst`` crosses."""
        ns, nd = self.grid.node(src), self.grid.node(dst)
        if ns == nd:
            if self.shared_cpu:
                return (("cpu", ns),)
            return (("out", src), ("in", dst))
        a, b = self.nic(src), self.nic(dst)
        path = [("nic_out", ns, a), ("nic_in", nd, b)]
        if self.oversub > 1 and not (self.rail and a == b):
            path += [("up", ns), ("down", nd)]
        return tuple(path)

    def byte_cost(self, res: Resource) -> float:
        """Units of ``res`` one byte of a transfer uses (core-seconds on a shared-CPU host)."""
        return 1.0 / self.intra_Bps if res[0] == "cpu" else 1.0

    def alpha(self, src: int, dst: int) -> float:
        """Per-hop latency between two ranks."""
        return self.cost.link_latency_s(self.cluster, self.inter(src, dst))
