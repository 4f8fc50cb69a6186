"""ClusterSpec: nodes, accelerators and the links between them."""

from __future__ import annotations

from dataclasses import dataclass, field

from twin.spec.errors import check_choice, check_positive, raise_if

INTRA_KINDS = ("nvswitch", "pcie", "shared_cpu")
INTER_KINDS = ("infiniband", "roce", "ethernet", "loopback")
TOPOLOGIES = ("fat_tree", "rail_optimized")


@dataclass(frozen=True)
class GPUSpec:
    """One accelerator (or, on ``cpu_local``, the share of the host one rank gets)."""

    name: str = "gpu"
    """Marketing name, e.g. H100-SXM5-80GB."""
    peak_tflops: dict[str, float] = field(default_factory=dict)
    """Dense peak TFLOP/s per dtype (bf16, fp16, fp32; fp8 and mxfp8 where the tensor cores
    have them): the denominator of MFU."""
    hbm_GB: float = 80.0
    """Device memory in GB (1e9 bytes)."""
    hbm_bw_GBps: float = 2000.0
    """Device memory bandwidth in GB/s."""
    sm_count: int | None = None
    """Streaming multiprocessors (A100 108, H100 SXM 132): a GEMM's output tiles run in
    waves of this many; None: no wave quantization (a CPU, or unknown)."""

    def peak_flops(self, dtype: str) -> float:
        """Peak FLOP/s for ``dtype``."""
        return self.peak_tflops[dtype] * 1e12


@dataclass(frozen=True)
class IntraNodeSpec:
    """The fabric between the devices of one node."""

    kind: str = "nvswitch"
    """nvswitch, pcie, or shared_cpu (ranks on one host talking over loopback)."""
    bw_GBps: float = 300.0
    """Bandwidth per device per direction, GB/s."""
    latency_us: float = 3.0
    """Per-hop latency, microseconds."""


@dataclass(frozen=True)
class InterNodeSpec:
    """The network between nodes."""

    kind: str = "infiniband"
    """infiniband, roce, ethernet, or loopback (single host)."""
    nics_per_node: int = 8
    """Compute NICs per node."""
    nic_bw_GBps: float = 25.0
    """Bandwidth per NIC per direction, GB/s."""
    latency_us: float = 5.0
    """Per-hop network latency, microseconds."""
    topology: str = "fat_tree"
    """fat_tree or rail_optimized."""
    oversubscription: float = 1.0
    """Ratio of down- to up-link bandwidth at the leaf switches (1 = non-blocking)."""


@dataclass(frozen=True)
class ClusterSpec:
    """A cluster of identical nodes."""

    name: str = "cluster"
    """Preset name, for reports."""
    num_nodes: int = 1
    """Nodes in the job."""
    gpus_per_node: int = 8
    """Devices (ranks) per node."""
    gpu: GPUSpec = field(default_factory=GPUSpec)
    """The accelerator."""
    intra: IntraNodeSpec = field(default_factory=IntraNodeSpec)
    """The intra-node fabric."""
    inter: InterNodeSpec = field(default_factory=InterNodeSpec)
    """The inter-node network."""
    cores_per_node: int | None = None
    """CPU cores the node's ranks share (``cpu_local``: ranks contend for them); None: not modelled."""

    def __post_init__(self) -> None:
        problems: list[str] = []
        for name in ("num_nodes", "gpus_per_node"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                problems.append(f"cluster.{name}={value!r} must be a positive integer")
        if self.cores_per_node is not None and (
                not isinstance(self.cores_per_node, int) or self.cores_per_node < 1):
            problems.append(f"cluster.cores_per_node={self.cores_per_node!r} must be a "
                            "positive integer or null")
        if not self.gpu.peak_tflops:
            problems.append("cluster.gpu.peak_tflops is empty; give at least one dtype, "
                            "e.g. {bf16: 989}")
        for dtype, tflops in self.gpu.peak_tflops.items():
            check_choice(problems, "cluster.gpu.peak_tflops key", dtype,
                         ("bf16", "fp16", "fp32", "fp8", "mxfp8"))
            check_positive(problems, f"cluster.gpu.peak_tflops.{dtype}", tflops)
        check_positive(problems, "cluster.gpu.hbm_GB", self.gpu.hbm_GB)
        check_positive(problems, "cluster.gpu.hbm_bw_GBps", self.gpu.hbm_bw_GBps)
        if self.gpu.sm_count is not None:
            check_positive(problems, "cluster.gpu.sm_count", self.gpu.sm_count)
        check_choice(problems, "cluster.intra.kind", self.intra.kind, INTRA_KINDS)
        check_positive(problems, "cluster.intra.bw_GBps", self.intra.bw_GBps)
        if self.intra.latency_us < 0:
            problems.append(f"cluster.intra.latency_us={self.intra.latency_us} must be >= 0")
        check_choice(problems, "cluster.inter.kind", self.inter.kind, INTER_KINDS)
        check_choice(problems, "cluster.inter.topology", self.inter.topology, TOPOLOGIES)
        check_positive(problems, "cluster.inter.nics_per_node", self.inter.nics_per_node)
        check_positive(problems, "cluster.inter.nic_bw_GBps", self.inter.nic_bw_GBps)
        if self.inter.latency_us < 0:
            problems.append(f"cluster.inter.latency_us={self.inter.latency_us} must be >= 0")
        if not (isinstance(self.inter.oversubscription, (int, float))
                and self.inter.oversubscription >= 1):
            problems.append(f"cluster.inter.oversubscription={self.inter.oversubscription!r} "
                            "must be >= 1 (1 = non-blocking)")
        raise_if(problems)

    @property
    def world_size(self) -> int:
        """Total devices: num_nodes * gpus_per_node."""
        return self.num_nodes * self.gpus_per_node

    @property
    def hbm_bytes(self) -> float:
        """Device memory in bytes."""
        return self.gpu.hbm_GB * 1e9
