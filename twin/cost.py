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
from twin.kernelshape import gemm_aligned, gemm_utilization, shape_key, timed_flops
from twin.profilecheck import profile_problems as _profile_problems
from twin.schedule.ir import Op
from twin.spec import ClusterSpec, ConfigError, GPUSpec
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
    """Fixed cost per op on the device (kernel launch gaps, tails)."""
    host_us: float = 0.0
    """CPU time the rank's host thread spends issuing one op of this kind (framework
    dispatch, autograd, kernel launches): the op cannot start before the host has issued it
    and the host issues in program order, so many small ops make a step host-bound."""
    tile: int = 0
    """GEMM output tile edge (cuBLAS: 128 on A100/H100): an m x n output takes
    ceil(m/tile) * ceil(n/tile) tiles, run in waves of the GPU's sm_count; the padded tiles
    and the idle SMs of the last wave are lost. 0: no tile or wave quantization."""
    tile_exponent: float = 1.0
    """How much of that loss is paid: efficiency x utilization ** this (cuBLAS's smaller
    tiles and split-K win some of it back; 0: none paid, 1: all)."""
    unaligned_efficiency: float = 1.0
    """Share of its efficiency a GEMM keeps when its n or k (the leading dimensions of a
    row-major m x k by k x n product) is not a multiple of 16 bytes' elements (8 in bf16):
    cuBLAS then cannot use its vectorized tensor-core kernels (GPT-2's 50,257-token vocabulary;
    Megatron pads the vocabulary for this). 1: no loss (CPUs; profiles that never measured it)."""


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
    host_comm_us: float = 0.0
    """Host time to issue one collective or send/recv (see KernelCost.host_us)."""
    host_comm_per_rank_us: float = 0.0
    """Host time a collective adds per member of its group (connections and channels NCCL
    sets up and launches on: larger groups cost the issuing host more)."""
    host_comm_by_group_us: dict = field(default_factory=dict)
    """Group role (dp, tp, pp, ...; dp-cp: dp) -> host time to issue one of its collectives or
    send/recvs, where it differs from host_comm_us: the framework layer issuing a call (DDP's
    and FSDP's hooks on dp, DTensor's redistribution on tp) costs its own (fitted on CPU)."""
    p2p_host_sync: bool = False
    """The host waits for each batch of send/recv ops and the work before it to finish
    before issuing more (Megatron: batch_isend_irecv, then torch.cuda.synchronize())."""
    p2p_latency_us: float | None = None
    """Fixed cost of a send/recv; None: one hop of the link's latency."""
    overlap_slowdown: float = 0.0
    """Compute runs 1 + this slower while a collective of its rank is in flight (sim/overlap.py)."""
    core_share: bool = True
    """On clusters with cores_per_node, ranks' compute shares the node's cores."""
    host_tp_gemm_us: float = 0.0
    """Host time a tensor-parallel linear's GEMM (Op.tp_gemm) adds: PyTorch's TP dispatches each
    op on a DTensor weight in Python; 0 where TP weights are plain tensors (Megatron). On CPU
    cores it is the computing thread's (twin.sim.thread), as the calls' host time is."""
    busy_handoff_us: float = 0.0
    """Shared CPU cores: a collective call started while its node's cores all compute waits
    this long more, its thread woken into a full run queue (fitted from traces; GPUs: 0)."""
    cores_effective: float | None = None
    """Cores the ranks of a shared-CPU node effectively share; None: cores_per_node."""
    kernels_by_dtype: dict = field(default_factory=dict)
    """dtype -> kind -> KernelCost fitted for that dtype (overrides the kind's default)."""
    collective_fits: dict = field(default_factory=dict)
    """"kind/link/n" -> {latency_us, bw_GBps, ...}: measured t = latency + S / bw per
    collective kind, link class (intra|inter) and group size n; S in nccl-tests' bytes."""
    eager_elementwise: float = 1.0
    """How many times the twin's fused bytes eager PyTorch moves for an elementwise op (its
    extra kernels), as folded into ``elementwise.mem_efficiency`` and ``host_us`` here (1:
    nothing folded, e.g. profiles fitted on fused kernels). ``compiled`` takes it back out."""
    compiled_reduction_efficiency: float = 1.0
    """Under torch.compile, the fraction of the fused elementwise bandwidth its reductions
    (``Op.reduction``: norms, loss) reach: 1 hand-tuned; ~0.5 for Inductor before its 2025
    tuning ("torch.compile ~50% of Quack performance typically" for LayerNorm/RMSNorm on
    H100, PyTorch blog "SOTA Normalization Performance with torch.compile")."""
    reduction_efficiency: float = 1.0
    """The factor on a reduction's memory efficiency this model applies (``kernel_of``): 1,
    except in a ``compiled`` model, which carries ``compiled_reduction_efficiency`` here."""
    shape_factors: dict = field(default_factory=dict)
    """``shape_key(op)`` -> measured over modelled time of that GEMM or attention shape: cuBLAS
    picks a kernel per shape (tiles, waves, split-K: a jagged function of m, n, k). From a
    kernel sweep or a step fit (``twin.calibrate.stepfit``); a shape not listed: the model."""
    compute_cv: float = 0.0
    """Run-to-run spread of compute ops (coefficient of variation) for jitter."""
    comm_cv: float = 0.0
    """Run-to-run spread of collectives."""
    provenance: dict = field(default_factory=dict)
    """Where the numbers come from (host, hardware, torch, backend, date, residuals)."""
    eager_model: CostModel | None = field(default=None, compare=False, repr=False)
    """In a ``compiled`` model, the eager one it came from: the ops torch.compile leaves
    outside its compiled blocks (Op.outside_blocks) are priced by it. Never written to a profile."""

    def compiled(self) -> CostModel:
        """This model under torch.compile (parallel.compile): each elementwise op one fused
        kernel, its memory efficiency and host time without the eager factor
        (``eager_elementwise``), reductions at ``compiled_reduction_efficiency`` of it; the
        ops outside the compiled blocks (``Op.outside_blocks``: torchtitan compiles each
        transformer block, not the embedding, final norm, loss or gradient clipping) as this
        model prices them; the same model when nothing changes."""
        f, r = self.eager_elementwise, self.compiled_reduction_efficiency
        if f == 1.0 and r == self.reduction_efficiency:
            return self
        by = {d: {kind: unfolded(k, f) if kind == "elementwise" else k
                  for kind, k in kinds.items()}
              for d, kinds in self.kernels_by_dtype.items()}
        return dataclasses.replace(self, elementwise=unfolded(self.elementwise, f),
                                   kernels_by_dtype=by, eager_elementwise=1.0,
                                   reduction_efficiency=r, name=f"{self.name}+compile",
                                   eager_model=self)

    def kernel(self, kind: str, dtype: str = "") -> KernelCost:
        by = self.kernels_by_dtype.get(dtype)
        if by and kind in by:
            return by[kind]
        return getattr(self, kind)

    def collective_fit(self, kind: str, link: str, n: int, role: str = "") -> dict | None:
        """The fit for this kind and link class at group size n (the nearest size measured),
        the group's role's own (``kind/link/n@role``, e.g. ``@tp``) before the others."""
        if not self.collective_fits:
            return None
        best, dist = None, None
        for key, fit in self.collective_fits.items():
            k, lnk, size = key.split("/")
            size, _, r = size.partition("@")
            if k == kind and lnk == link and r in ("", role):
                d = (abs(math.log(int(size) / n)), not r)
                if dist is None or d < dist:
                    best, dist = fit, d
        return best

    def kernel_of(self, op: Op) -> KernelCost:
        """A compute op's kernel cost: its kind's (for its dtype); an elementwise op that is one
        kernel in eager PyTorch too (``Op.one_kernel``: FSDP2's copies) without the
        eager factor folded into the kind (``eager_elementwise``); a reduction
        (``Op.reduction``) at ``reduction_efficiency`` of the kind's memory efficiency; in a
        ``compiled`` model an op outside the compiled blocks as the eager model has it."""
        if self.eager_model is not None and op.outside_blocks:
            return self.eager_model.kernel_of(op)
        k = self.kernel(op.kind, op.dtype)
        if self.eager_elementwise != 1.0 and op.one_kernel:
            return unfolded(k, self.eager_elementwise)
        if self.reduction_efficiency != 1.0 and op.reduction:
            return dataclasses.replace(k, mem_efficiency=k.mem_efficiency * self.reduction_efficiency)
        return k

    def compute_time(self, op: Op, gpu: GPUSpec) -> float:
        """Seconds of one compute op on ``gpu`` (roofline with this profile's efficiencies)."""
        k = self.kernel_of(op)
        flops = timed_flops(op)
        t = 0.0
        if flops:
            eff = k.efficiency * (flops / (flops + k.half_flops) if k.half_flops else 1.0)
            if k.tile and op.kind == "gemm" and len(op.shape) >= 2:
                eff *= gemm_utilization(op.shape[0], op.shape[1], k.tile,
                                        gpu.sm_count) ** k.tile_exponent
            if k.unaligned_efficiency != 1.0 and op.kind == "gemm" and not gemm_aligned(op):
                eff *= k.unaligned_efficiency
            t = flops / (gpu.peak_flops(op.dtype or "bf16") * eff)
        if op.bytes:
            t = max(t, op.bytes / (gpu.hbm_bw_GBps * 1e9 * k.mem_efficiency))
        if self.shape_factors and op.kind in SHAPED_KINDS:
            t *= self.shape_factors.get(shape_key(op), 1.0)
        return t + k.launch_us * 1e-6

    def host_time(self, op: Op) -> float:
        """Seconds the host spends issuing ``op`` (0 for memory bookkeeping)."""
        if op.is_compute:
            return (self.kernel_of(op).host_us + (self.host_tp_gemm_us if op.tp_gemm else 0.0)) * 1e-6
        if op.is_collective:
            return (self.comm_host_us(call_role(op)) + self.host_comm_per_rank_us * len(op.group)) \
                * 1e-6
        if op.is_p2p:
            return self.comm_host_us(call_role(op)) * 1e-6
        return 0.0

    def comm_host_us(self, role: str) -> float:
        """Host microseconds to issue one call on a group of ``role`` (call_role); a role
        without a price takes its group's (fsdp: dp), then ``host_comm_us``."""
        by = self.host_comm_by_group_us
        if role in by:
            return by[role]
        return by.get(ROLE_FALLBACK.get(role, role), self.host_comm_us)

    def link_latency_s(self, cluster: ClusterSpec, inter: bool) -> float:
        lc = self.inter if inter else self.intra
        lat = lc.latency_us
        if lat is None:
            lat = cluster.inter.latency_us if inter else cluster.intra.latency_us
        return lat * 1e-6

    def to_dict(self) -> dict:
        d = dataclasses.asdict(dataclasses.replace(self, eager_model=None))
        return {"format": PROFILE_FORMAT, "version": PROFILE_VERSION,
                **{k: v for k, v in d.items() if k != "eager_model"}}

    def save(self, path: str | Path) -> Path:
        """Write atomically: a half-written profile never replaces a good one."""
        return write_text_atomic(path, yaml.safe_dump(self.to_dict(), sort_keys=False))

    @classmethod
    def from_dict(cls, data: dict, where: str = "profile") -> CostModel:
        """A profile from its YAML data; ConfigError naming the file, every bad key path
        (unknown keys with the closest known one, numbers out of range) and the fix."""
        if not isinstance(data, dict) or data.get("format") != PROFILE_FORMAT:
            raise ConfigError(f"{where} is not a paratwin calibration profile (no 'format: "
                              f"{PROFILE_FORMAT}'); write one with `paratwin calibrate`")
        if data.get("version") != PROFILE_VERSION:
            raise ConfigError(f"{where}: profile version {data.get('version')} is not supported "
                              f"(this paratwin reads version {PROFILE_VERSION})")
        problems = profile_problems(data)
        if problems:
            raise ConfigError(f"{where}: {'; '.join(problems)}; correct the file or fit a new "
                              "profile with `paratwin calibrate`")
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
        return cls(**kw)

    @classmethod
    def load(cls, path: str | Path) -> CostModel:
        path = Path(path)
        if path.is_dir():
            raise ConfigError(f"{path} is a directory, not a profile; give a profile file "
                              "(conf/profiles/NAME.yaml, or RUN_DIR/profile.yaml of a "
                              "`paratwin calibrate` run)")
        try:
            data = yaml.safe_load(path.read_text())
        except (yaml.YAMLError, UnicodeDecodeError) as err:
            raise ConfigError(f"{path} is not a paratwin calibration profile (not YAML: "
                              f"{str(err).splitlines()[0]})") from None
        return cls.from_dict(data, str(path))

    def cluster_mismatch(self, cluster: ClusterSpec) -> str | None:
        """Why this profile describes other hardware than ``cluster`` (its provenance names
        the cluster it was fitted on, and whether that had GPUs), else None."""
        prov = self.provenance if isinstance(self.provenance, dict) else {}
        fitted = prov.get("cluster")
        if fitted is None:
            return None  # published defaults, or a hand-written profile: nothing recorded
        cpu_profile = prov.get("backend") == "gloo" or prov.get("gpus") == []
        cpu_cluster = cluster.intra.kind == "shared_cpu"
        if str(fitted) == cluster.name and cpu_profile == cpu_cluster:
            return None
        kind = "a CPU" if cpu_profile else "a GPU"
        return (f"profile {self.name} was fitted on cluster {fitted} ({kind} profile) but this "
                f"job runs on {cluster.name}: its efficiencies and collective fits describe the "
                f"other hardware; calibrate this one (`paratwin calibrate cluster={cluster.name}`)"
                " or leave calibration unset for the published defaults")


SHAPE_RANGE = (0.25, 4.0)
"""Bounds of a fitted kernel shape's factor (measured over modelled time)."""
SHAPED_KINDS = ("gemm", "attention")
"""Compute kinds whose time ``CostModel.shape_factors`` can set per shape."""


ROLE_FALLBACK = {"fsdp": "dp"}
"""A call role priced by its group's when it has no price of its own."""


def call_role(op: Op) -> str:
    """The group role a collective or send/recv is priced by in host_comm_by_group_us: its
    group's name up to the first '-' (dp-cp: dp), pp for an unnamed send/recv; FSDP's
    gathers and reduce-scatters ``fsdp`` (its hooks are not DDP's bucket all-reduce)."""
    if op.paradigm == "fsdp":
        return "fsdp"
    return op.group_name.partition("-")[0] or "pp"


def profile_problems(data: dict) -> list[str]:
    """Every problem of a profile's data, each naming its key path (empty: fine)."""
    return _profile_problems(data, [f.name for f in dataclasses.fields(CostModel)
                                    if f.name != "eager_model"])


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


def unfolded(k: KernelCost, eager: float) -> KernelCost:
    """An elementwise kernel cost with the eager factor ``eager`` (``eager_elementwise``) taken
    back out: its memory efficiency times it (at most 1), its host time over it."""
    return dataclasses.replace(k, mem_efficiency=min(1.0, k.mem_efficiency * eager),
                               host_us=k.host_us / eager)
