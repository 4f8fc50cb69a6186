"""The calibratable cost model: compute roofline, link efficiencies, collective latency, noise.

Compute (roofline, Williams et al. 2009): t = max(F / (peak * eff(F)), B / (hbm_bw * mem_eff))
+ launch, with eff(F) = eff_max * F / (F + F_half) rising with the op's size. Links: a
transfer of S bytes over a link of line rate R moves at R * bw_efficiency (NCCL reaches
~370 of 450 GB/s on H100 NVLink, 46-49 of 50 GB/s per NDR NIC: published.md §5.2).
Collectives: ring all-reduce of S over n ranks, uncontended: 2(n-1)*alpha + 2(n-1)/n * S/B
(nccl-tests PERFORMANCE.md; NCCL's latency model, published.md §5.3).

A profile is a YAML file (``format: paratwin-profile``): the defaults below come from
published figures; ``paratwin calibrate`` fits one from measurements.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from twin.files import write_text_atomic
from twin.schedule.ir import Op
from twin.spec import ClusterSpec, GPUSpec
from twin.vocab import COMPUTE_KINDS

PROFILE_FORMAT = "paratwin-profile"
PROFILE_VERSION = 1


@dataclass(frozen=True)
class KernelCost:
    """Efficiency curve and launch overhead of one compute kind."""

    efficiency: float = 0.7
    """Largest fraction of peak FLOP/s reached (eff_max)."""
    half_flops: float = 0.0
    """FLOPs at which half of eff_max is reached (F_half); 0: flat."""
    mem_efficiency: float = 0.8
    """Fraction of HBM bandwidth reached by the op's memory traffic."""
    launch_us: float = 5.0
    """Fixed cost per op (kernel launch, framework overhead)."""


@dataclass(frozen=True)
class LinkCost:
    """Achieved bandwidth and per-hop latency of one link class."""

    bw_efficiency: float = 0.9
    latency_us: float | None = None
    """Per-hop latency alpha; None: the cluster's figure."""


@dataclass(frozen=True)
class CostModel:
    """Everything the twin needs to turn an op into time."""

    name: str = "defaults"
    gemm: KernelCost = KernelCost(efficiency=0.7, half_flops=2e9, launch_us=5.0)
    """cuBLAS reaches about 70% of dense bf16 peak on transformer-sized GEMMs (A100, H100)."""
    attention: KernelCost = KernelCost(efficiency=0.55, half_flops=2e9, launch_us=8.0)
    elementwise: KernelCost = KernelCost(efficiency=0.5, mem_efficiency=0.8, launch_us=4.0)
    optimizer: KernelCost = KernelCost(efficiency=0.5, mem_efficiency=0.7, launch_us=20.0)
    intra: LinkCost = LinkCost(bw_efficiency=0.82)
    inter: LinkCost = LinkCost(bw_efficiency=0.95)
    base_latency_us: float = 8.4
    """Fixed cost of every collective (NCCL baseLat, ring, Simple: 8.4 us)."""
    p2p_latency_us: float | None = None
    """Fixed cost of a send/recv; None: one hop of the link's latency."""
    overlap_slowdown: float = 0.0
    """Compute slows by this fraction while communication runs beside it on its rank."""
    core_share: bool = True
    """On clusters with cores_per_node, ranks' compute shares the node's cores."""
    cores_effective: float | None = None
    """Cores the ranks of a shared-CPU node effectively share; None: cores_per_node."""
    kernels_by_dtype: dict = field(default_factory=dict)
    """dtype -> kind -> KernelCost fitted for that dtype (overrides the kind's default)."""
    collective_fits: dict = field(default_factory=dict)
    """"kind/link/n" -> {latency_us, bw_GBps, ...}: measured t = latency + S / bw per
    collective kind, link class (intra|inter) and group size n; S in nccl-tests' bytes."""
    compute_cv: float = 0.0
    """Run-to-run spread of compute ops (coefficient of variation) for jitter."""
    comm_cv: float = 0.0
    """Run-to-run spread of collectives."""
    provenance: dict = field(default_factory=dict)
    """Where the numbers come from (host, hardware, torch, backend, date, residuals)."""

    def kernel(self, kind: str, dtype: str = "") -> KernelCost:
        by = self.kernels_by_dtype.get(dtype)
        if by and kind in by:
            return by[kind]
        return getattr(self, kind)

    def collective_fit(self, kind: str, link: str, n: int) -> dict | None:
        """The fit for this kind and link class at group size n (the nearest size measured)."""
        if not self.collective_fits:
            return None
        best, dist = None, None
        for key, fit in self.collective_fits.items():
            k, lnk, size = key.split("/")
            if k == kind and lnk == link:
                d = abs(math.log(int(size) / n))
                if dist is None or d < dist:
                    best, dist = fit, d
        return best

    def compute_time(self, op: Op, gpu: GPUSpec) -> float:
        """Seconds of one compute op on ``gpu`` (roofline with this profile's efficiencies)."""
        k = self.kernel(op.kind, op.dtype)
        flops = op.flops
        if op.kind == "attention" and len(op.shape) > 5 and op.shape[5]:
            flops *= 0.5  # a causal kernel skips the masked half of the square
        t = 0.0
        if flops:
            eff = k.efficiency * (flops / (flops + k.half_flops) if k.half_flops else 1.0)
            t = flops / (gpu.peak_flops(op.dtype or "bf16") * eff)
        if op.bytes:
            t = max(t, op.bytes / (gpu.hbm_bw_GBps * 1e9 * k.mem_efficiency))
        return t + k.launch_us * 1e-6

    def link_latency_s(self, cluster: ClusterSpec, inter: bool) -> float:
        lc = self.inter if inter else self.intra
        lat = lc.latency_us
        if lat is None:
            lat = cluster.inter.latency_us if inter else cluster.intra.latency_us
        return lat * 1e-6

    # -- files ---------------------------------------------------------------------------
    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        return {"format": PROFILE_FORMAT, "version": PROFILE_VERSION, **d}

    def save(self, path: str | Path) -> Path:
        """Write atomically: a half-written profile never replaces a good one."""
        return write_text_atomic(path, yaml.safe_dump(self.to_dict(), sort_keys=False))

    @classmethod
    def from_dict(cls, data: dict, where: str = "profile") -> CostModel:
        if not isinstance(data, dict) or data.get("format") != PROFILE_FORMAT:
            raise ValueError(f"{where} is not a paratwin calibration profile (no 'format: "
                             f"{PROFILE_FORMAT}'); write one with `paratwin calibrate`")
        if data.get("version") != PROFILE_VERSION:
            raise ValueError(f"{where}: profile version {data.get('version')} is not supported "
                             f"(this paratwin reads version {PROFILE_VERSION})")
        kw = {}
        for f in dataclasses.fields(cls):
            if f.name not in data:
                continue
            v = data[f.name]
            if f.name in COMPUTE_KINDS:
                v = KernelCost(**v)
            elif f.name in ("intra", "inter"):
                v = LinkCost(**v)
            elif f.name == "kernels_by_dtype":
                v = {dt: {k: KernelCost(**kc) for k, kc in kinds.items()} for dt, kinds in v.items()}
            kw[f.name] = v
        unknown = set(data) - {f.name for f in dataclasses.fields(cls)} - {"format", "version"}
        if unknown:
            raise ValueError(f"{where}: unknown profile fields {sorted(unknown)}")
        return cls(**kw)

    @classmethod
    def load(cls, path: str | Path) -> CostModel:
        path = Path(path)
        try:
            data = yaml.safe_load(path.read_text())
        except (yaml.YAMLError, UnicodeDecodeError) as err:
            raise ValueError(f"{path} is not a paratwin calibration profile (not YAML: "
                             f"{str(err).splitlines()[0]})") from None
        return cls.from_dict(data, str(path))


def default_cost_model(cluster: ClusterSpec) -> CostModel:
    """Published-figure defaults for a cluster's link classes (published.md §5-6)."""
    intra = {"nvswitch": 0.82, "pcie": 0.8, "shared_cpu": 1.0}[cluster.intra.kind]
    inter = {"infiniband": 0.95, "roce": 0.9, "ethernet": 0.8, "loopback": 1.0}[cluster.inter.kind]
    model = CostModel(name=f"defaults-{cluster.name}", intra=LinkCost(bw_efficiency=intra),
                      inter=LinkCost(bw_efficiency=inter),
                      provenance={"source": "published figures (shared/reference/published.md)"})
    if cluster.intra.kind == "shared_cpu":
        # a CPU rank: peak_tflops was measured on a large GEMM; PyTorch eager op overhead
        model = dataclasses.replace(
            model, gemm=KernelCost(efficiency=0.9, half_flops=2e6, mem_efficiency=0.8, launch_us=15),
            attention=KernelCost(efficiency=0.5, half_flops=2e6, mem_efficiency=0.5, launch_us=40),
            elementwise=KernelCost(efficiency=0.3, mem_efficiency=0.5, launch_us=10),
            optimizer=KernelCost(efficiency=0.3, mem_efficiency=0.4, launch_us=30),
            base_latency_us=60.0)
    return model


def ring_allreduce_time(nbytes: float, n: int, bw_Bps: float, alpha_s: float) -> float:
    """Closed form, uncontended: 2(n-1)*alpha + 2(n-1)/n * S/B."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) * alpha_s + 2 * (n - 1) / n * nbytes / bw_Bps


def tree_allreduce_time(nbytes: float, n: int, bw_Bps: float, alpha_s: float) -> float:
    """Closed form, uncontended, double binary tree (NCCL): 2*log2(n)*alpha + 2*S/B
    (reduce up and broadcast down, pipelined; each link carries S each way)."""
    if n <= 1:
        return 0.0
    return 2 * math.ceil(math.log2(n)) * alpha_s + 2 * nbytes / bw_Bps
