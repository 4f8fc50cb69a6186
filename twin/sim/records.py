"""The engine's records and options: what a simulation is asked (SimOptions, fold classes)
and the typed state it keeps (bundled flows, rendezvous, p2p pairs, stream structure)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import simpy

from twin.sim.topology import Resource
from twin.spec import ConfigError, Job

RendezvousKey = tuple[tuple[int, ...], str]
"""A collective's rendezvous: (its group's ranks, the op's name)."""
PairKey = tuple[int, int, str]
"""A send/recv pair: (src, dst, tag)."""


@dataclass
class SimOptions:
    """What-if knobs and fidelity options of one simulation."""

    fold: str = "none"
    """none, dp, tp or all: axes whose ranks are simulated once (exact copies)."""
    algorithm: str = "auto"
    """Collective algorithm: auto (hierarchical across nodes, else ring), ring, tree."""
    straggler: dict[int, float] = field(default_factory=dict)
    """rank -> compute slowdown factor (2.0: that rank computes at half speed)."""
    degraded: dict[Resource, float] = field(default_factory=dict)
    """fabric resource -> bandwidth factor, e.g. {("nic_out", 0, 0): 0.5}."""
    jitter: bool = False
    """Draw compute and collective noise from the profile's compute_cv / comm_cv."""
    seed: int = 0


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
    """The axes ``fold`` folds (ConfigError for legacy DP, whose device 0 differs)."""
    if fold not in FOLD_AXES:
        raise ConfigError(f"fold={fold!r} is not one of {'|'.join(FOLD_AXES)}")
    dims = FOLD_AXES[fold]
    if job.parallel.legacy_dp and "dp" in dims:
        raise ConfigError(f"fold={fold} cannot fold legacy DP: device 0 differs from the "
                          "others; use fold=none (or fold=tp)")
    return dims


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
    """One fabric flow standing for a phase's flows (see Simulation._bundle_spec)."""

    resources: tuple[Resource, ...]
    weights: tuple[float, ...]
    """Per resource: how many of the phase's flows (and their folded copies) cross it."""
    size_bytes: float
    """The largest per-flow byte count: the bundle moves at its most loaded resource's pace."""
    byte_costs: tuple[float, ...]
    """Per resource: units of it one byte uses (Topology.byte_cost)."""


class Fitted(NamedTuple):
    """A collective's phases after a measured latency/bandwidth fit (Simulation._fitted)."""

    bundles: list[Bundle | None]
    latencies_s: list[float]
    """Per-phase latency."""
    base_latency_s: float
    """Added once, before the first phase."""


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
