"""The engine's records and options: what a simulation is asked (SimOptions, fold classes)
and the typed state it keeps (bundled flows, rendezvous, p2p pairs, stream structure)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import simpy

from twin.sim.topology import Resource
from twin.spec import ConfigError, Job
from twin.spec.experts import has_expert_groups

RendezvousKey = tuple[tuple[int, ...], str]
"""A collective's rendezvous: (its group's ranks, the op's name)."""
PairKey = tuple[int, int, str]
"""A send/recv pair: (src, dst, tag)."""


@dataclass
class SimOptions:
    """What-if knobs and fidelity options of one simulation."""

    fold: str = "none"
    """none, dp, tp, all or auto: axes whose ranks are simulated once (exact copies); auto:
    every axis whose copies are exact (``resolve_options``)."""
    algorithm: str = "auto"
    """Collective algorithm: auto (hierarchical across nodes, else ring), ring, tree."""
    straggler: dict[int, float] = field(default_factory=dict)
    """rank -> compute slowdown factor (2.0: that rank computes at half speed)."""
    degraded: dict[Resource, float] = field(default_factory=dict)
    """fabric resource -> bandwidth factor, e.g. {("nic_out", 0, 0): 0.5}."""
    jitter: bool = False
    """Draw compute and collective noise from the profile's compute_cv / comm_cv."""
    seed: int = 0
    fast_forward: bool = True
    """Advance a pipeline's steady state by whole periods once it repeats
    (twin/sim/fastforward.py); off by itself with jitter or a what-if."""


FOLD_AXES = {"none": (), "dp": ("dp",), "tp": ("tp",), "all": ("dp", "tp")}
"""Each fold and the grid axes whose ranks it simulates once."""


def _offsets(grid, dims) -> list[int]:
    """Rank offsets of every combination of coordinates along ``dims``, ascending."""
    out = [0]
    for d in dims:
        if grid.size(d) > 1:
            stride = grid.rank(**{d: 1})
            out = [o + i * stride for o in out for i in range(grid.size(d))]
    return sorted(out)


def folded_axes(job: Job, fold: str) -> tuple[str, ...]:
    """The axes ``fold`` folds (ConfigError for legacy DP, whose device 0 differs); auto:
    those ``exact_axes`` allows (what-ifs aside: ``twin.sim.run.resolve_options``)."""
    if fold == "auto":
        fold = auto_fold(job)
    if fold not in FOLD_AXES:
        raise ConfigError(f"fold={fold!r} is not one of {'|'.join([*FOLD_AXES, 'auto'])}")
    dims = FOLD_AXES[fold]
    if dims and has_expert_groups(job.model, job.parallel):
        raise ConfigError(f"fold={fold} cannot fold a plan with expert parallelism (ep="
                          f"{job.parallel.ep}, etp={job.parallel.expert_tp}): its ranks send "
                          "and compute different token counts; use fold=none or auto")
    if job.parallel.legacy_dp and "dp" in dims:
        raise ConfigError(f"fold={fold} cannot fold legacy DP: device 0 differs from the "
                          "others; use fold=none (or fold=tp)")
    return dims


def exact_axes(job: Job, algorithm: str = "auto") -> tuple[str, ...]:
    """The folded axes (dp, tp) whose copies are exact: some relabelling of the axis's
    coordinates maps the machine onto itself (each node's ranks to one node's, each NIC's to
    one NIC's) and every group onto a group, so every copy meets what its representative
    meets. Moving along an axis of stride s and size n on nodes of g GPUs does so when

    - s is a multiple of g: whole nodes move;
    - the axis stays inside a node in blocks that tile it (s n divides g);
    - or it spans whole nodes with g / s of its ranks on each (s divides g, g divides s n),
      relabelled as a move of whole nodes and a rotation inside each node; its groups' rings
      are then only preserved by the hierarchical algorithm (``algorithm`` auto), whose
      rings run inside each node and across nodes by position;

    and, inside a node, a step moves whole NIC blocks (or stays inside one). Legacy DP's
    device 0 differs from the other replicas: never folded."""
    grid, c = job.grid, job.cluster
    if has_expert_groups(job.model, job.parallel):
        return ()  # expert groups borrow ranks across axes: a copy meets other traffic
    gpn = c.gpus_per_node
    per_nic = max(1, gpn // max(1, c.inter.nics_per_node))

    def inside(step: int, block: int) -> bool:  # a rotation of ``block`` ranks ``step`` apart
        return gpn % block == 0 and gpn % per_nic == 0 and (
            step % per_nic == 0 or (block <= per_nic and per_nic % block == 0))

    out = []
    for axis in ("dp", "tp"):
        n = grid.size(axis)
        if n == 1 or (axis == "dp" and job.parallel.legacy_dp):
            continue
        s = grid.rank(**{axis: 1})
        if s % gpn == 0 or (s * n <= gpn and inside(s, s * n)) or (
                algorithm in ("auto", "hierarchical") and gpn % s == 0 and (s * n) % gpn == 0
                and inside(s, gpn)):
            out.append(axis)
    return tuple(out)


def auto_fold(job: Job, algorithm: str = "auto") -> str:
    """The fold ``auto`` stands for: every axis ``exact_axes`` allows."""
    axes = exact_axes(job, algorithm)
    if not axes:
        return "none"
    return "all" if set(axes) == {a for a in ("dp", "tp") if job.grid.size(a) > 1} else axes[0]


def fold_rep(job: Job, fold: str, rank: int) -> int:
    """The rank simulated for ``rank`` under ``fold`` (its class's representative)."""
    grid = job.grid
    return rank - sum(grid.coord(rank, d) * grid.rank(**{d: 1})
                      for d in folded_axes(job, fold) if grid.size(d) > 1)


def fold_classes(job: Job, fold: str, progress=None) -> dict[int, list[int]]:
    """Representative rank -> the ranks it stands for (itself first), representatives in
    ascending order. Built from the grid's strides, not rank by rank: representatives are
    the ranks at coordinate 0 of every folded axis, a class is its representative plus
    every offset along the folded axes. ``progress(done, total, what)`` as in simulate."""
    grid = job.grid
    dims = folded_axes(job, fold)
    copies = _offsets(grid, dims)
    reps = _offsets(grid, [d for d in grid.order if d not in dims])
    out: dict[int, list[int]] = {}
    for k, rep in enumerate(reps):
        out[rep] = [rep + o for o in copies]
        if progress and not k & 65535:
            progress(k, len(reps), "folding ranks")
    return out


class Bundle(NamedTuple):
    """One fabric flow standing for a phase's flows (twin.sim.flows.FlowPlanner)."""

    resources: tuple[Resource, ...]
    weights: tuple[float, ...]
    """Per resource: how many of the phase's flows (and their folded copies) cross it."""
    size_bytes: float
    """The largest per-flow byte count: the bundle moves at its most loaded resource's pace."""
    byte_costs: tuple[float, ...]
    """Per resource: units of it one byte uses (Topology.byte_cost)."""


@dataclass(slots=True)
class Rendezvous:
    """A collective waiting for its simulated members."""

    members_left: int
    """Simulated members yet to arrive; the last one starts the collective."""
    done: simpy.Event
    """Fires when the collective completes."""


@dataclass(slots=True)
class P2PPair:
    """A send/recv pair waiting for its two sides."""

    done: simpy.Event
    """Fires when the transfer completes."""
    arrived: int = 0
    """Sides that have reached it (the transfer starts at 2, or at 1 when the peer is folded)."""


class Structure(NamedTuple):
    """What every rank of one program template shares (Simulation._structure)."""

    streams: dict[str, list[int]]
    """Stream -> indices of its ops in order (memory ops excluded)."""
    external: set[int]
    """Ops that another stream (or a p2p op) waits for: they get completion events."""
    ext_deps: list[tuple[int, ...]]
    """Per op: its dependencies among ``external``."""
    base_s: list[float]
    """Per op: compute time before straggler, jitter and overlap factors (0 for the rest)."""
    host: object = None
    """The host's plan (twin.sim.host.HostPlan): issue times and sync points; None when
    the host neither costs nor waits."""
