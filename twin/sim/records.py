"""The engine's records and options: what a simulation is asked (SimOptions, fold classes)
and the typed state it keeps (bundled flows, rendezvous, p2p pairs, stream structure)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import simpy

from twin.schedule.builder import Shift, symmetric_shifts
from twin.sim.topology import Resource
from twin.spec import ConfigError, Job

RendezvousKey = tuple[tuple[int, ...], str]
"""A collective's rendezvous: (its group's ranks, the op's name)."""
PairKey = tuple
"""A send/recv pair: (src, dst, tag); a folded peer's pair is ("mirror", rank, tag), the
rank's own send and recv of that tag (twin.sim.sendrecv.SendRecv.arrive)."""


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


def _offsets(parts) -> list[int]:
    """Rank offsets of every combination of positions along ``parts`` ((stride, size)
    pairs), ascending."""
    out = [0]
    for stride, size in parts:
        if size > 1:
            out = [o + i * stride for o in out for i in range(size)]
    return sorted(out)


def folded_shifts(job: Job, fold: str) -> tuple[Shift, ...]:
    """The shifts ``fold`` simulates once: each of its axes's symmetric shifts (the whole axis
    for a dense plan; under expert parallelism the moves that keep expert groups and token
    counts, twin.schedule.builder.symmetric_shifts). ConfigError for legacy DP (device 0
    differs) and for an expert-parallel axis no shift keeps; auto: those ``exact_axes``
    allows (what-ifs aside: ``twin.sim.run.resolve_options``)."""
    if fold == "auto":
        fold = auto_fold(job)
    if fold not in FOLD_AXES:
        raise ConfigError(f"fold={fold!r} is not one of {'|'.join([*FOLD_AXES, 'auto'])}")
    dims = FOLD_AXES[fold]
    if job.parallel.legacy_dp and "dp" in dims:
        raise ConfigError(f"fold={fold} cannot fold legacy DP: device 0 differs from the "
                          "others; use fold=none (or fold=tp)")
    shifts = symmetric_shifts(job)
    stuck = [d for d in dims if job.grid.size(d) > 1 and d not in shifts]
    if stuck:
        raise ConfigError(f"fold={fold} cannot fold a plan with expert parallelism along "
                          f"{' and '.join(stuck)} (ep={job.parallel.ep}, etp="
                          f"{job.parallel.expert_tp}): {_why_not(job)}; use fold=none or auto")
    return tuple(s for d in dims if d in shifts for s in shifts[d])


def folded_axes(job: Job, fold: str) -> tuple[str, ...]:
    """The axes ``fold`` folds (in part under expert parallelism: ``folded_shifts``)."""
    return tuple(dict.fromkeys(s.axis for s in folded_shifts(job, fold)))


def _why_not(job: Job) -> str:
    """Why no shift along an axis keeps an expert-parallel plan's programs."""
    if job.model.moe is not None and job.model.moe.routing != "uniform":
        return ("moving a rank along it changes its expert groups or its EP rank, and under "
                f"{job.model.moe.routing} routing each EP rank receives and computes its own "
                "token counts")
    return "moving a rank along it changes its expert groups or the token counts it routes"


def exact_shifts(job: Job, algorithm: str = "auto") -> tuple[Shift, ...]:
    """The symmetric shifts (dp, tp) whose copies are exact: some relabelling of the
    positions maps the machine onto itself (each node's ranks to one node's, each NIC's to
    one NIC's) and every group onto a group, so every copy meets what its representative
    meets. Moving along a shift of stride s and size n on nodes of g GPUs does so when

    - s is a multiple of g: whole nodes move;
    - the shift stays inside a node in blocks that tile it (s n divides g);
    - or it spans whole nodes with g / s of its ranks on each (s divides g, g divides s n),
      relabelled as a move of whole nodes and a rotation inside each node; its groups' rings
      are then only preserved by the hierarchical algorithm (``algorithm`` auto), whose
      rings run inside each node and across nodes by position (not async TP's send/recv
      ring along tp: its links differ per rank there);

    and, inside a node, a step moves whole NIC blocks (or stays inside one). A send/recv to a
    folded copy meets the representative's own opposite side of the same tag
    (twin.sim.sendrecv). Legacy DP's device 0 differs from the other replicas: never folded.
    Under expert parallelism an axis may have a shift per expert digit it holds
    (symmetric_shifts): it is exact when each is."""
    c = job.cluster
    gpn = c.gpus_per_node
    per_nic = max(1, gpn // max(1, c.inter.nics_per_node))

    def inside(step: int, block: int) -> bool:  # a rotation of ``block`` ranks ``step`` apart
        return gpn % block == 0 and gpn % per_nic == 0 and (
            step % per_nic == 0 or (block <= per_nic and per_nic % block == 0))

    def exact(s: int, n: int, rings: bool = True) -> bool:
        return s % gpn == 0 or (s * n <= gpn and inside(s, s * n)) or (
            rings and algorithm in ("auto", "hierarchical") and gpn % s == 0
            and (s * n) % gpn == 0 and inside(s, gpn))

    ring = job.parallel.async_tp  # tp's send/recv ring: no hierarchical relabelling
    return tuple(s for axis, shifts in symmetric_shifts(job).items()
                 if all(exact(s.stride, s.size, not (ring and axis == "tp")) for s in shifts)
                 for s in shifts)


def exact_axes(job: Job, algorithm: str = "auto") -> tuple[str, ...]:
    """The axes of ``exact_shifts``."""
    return tuple(s.axis for s in exact_shifts(job, algorithm))


def auto_fold(job: Job, algorithm: str = "auto") -> str:
    """The fold ``auto`` stands for: every axis ``exact_axes`` allows."""
    axes = exact_axes(job, algorithm)
    if not axes:
        return "none"
    return "all" if set(axes) == {a for a in ("dp", "tp") if job.grid.size(a) > 1} else axes[0]


def unfolded_note(job: Job, algorithm: str = "auto") -> str | None:
    """What fold=auto leaves unfolded and why (None: every dp and tp copy is folded)."""
    exact = exact_axes(job, algorithm)
    left = [a for a in ("dp", "tp") if job.grid.size(a) > 1 and a not in exact
            and not (a == "dp" and job.parallel.legacy_dp)]
    if not left:
        return None
    return _unfolded(job, left, exact, symmetric_shifts(job))


def _unfolded(job: Job, left: list[str], exact, shifts) -> str:
    stuck = [a for a in left if a not in shifts]
    linked = [a for a in left if a in shifts]
    links = (f"moving a rank along {'them' if len(linked) > 1 else 'it'} changes the links "
             f"it meets ({job.cluster.gpus_per_node} GPUs and "
             f"{job.cluster.inter.nics_per_node} NICs per node)")
    if not stuck:
        return f"fold=auto leaves {' and '.join(left)} unfolded: {links}"
    head = "simulates every rank" if not exact else f"leaves {' and '.join(left)} unfolded"
    out = (f"fold=auto {head}: along {' and '.join(stuck)}, under expert parallelism (ep="
           f"{job.parallel.ep}, etp={job.parallel.expert_tp}), {_why_not(job)}")
    return out + (f"; along {' and '.join(linked)}, {links}" if linked else "")


def fold_rep(job: Job, fold: str, rank: int) -> int:
    """The rank simulated for ``rank`` under ``fold`` (its class's representative)."""
    return rank - sum(s.value(rank) * s.stride for s in folded_shifts(job, fold))


def fold_classes(job: Job, fold: str, progress=None) -> dict[int, list[int]]:
    """Representative rank -> the ranks it stands for (itself first), representatives in
    ascending order. Built from the grid's strides, not rank by rank: representatives are
    the ranks at position 0 of every folded shift, a class is its representative plus
    every offset along the folded shifts. ``progress(done, total, what)`` as in simulate."""
    grid = job.grid
    shifts = folded_shifts(job, fold)
    copies = _offsets((s.stride, s.size) for s in shifts)
    rest = []  # the digits of every axis that no folded shift moves
    for d in grid.order:
        stride, done = grid.rank(**{d: 1}) if grid.size(d) > 1 else 0, 1
        for s in sorted((s for s in shifts if s.axis == d), key=lambda s: s.step):
            rest.append((stride * done, s.step // done))
            done = s.step * s.size
        rest.append((stride * done, grid.size(d) // done))
    reps = _offsets(rest)
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

    def alone_rate(self, capacity: dict) -> float:
        """Bytes per second when no other flow is on its resources: the fabric's rate law
        (twin.sim.fabric.Fabric._rate) under its own load alone."""
        return min(capacity[r] / (w * c) for r, w, c in zip(self.resources, self.weights,
                                                            self.byte_costs))


@dataclass(slots=True)
class Rendezvous:
    """A collective waiting for its simulated members."""

    members_left: int
    """Simulated members yet to arrive; the last one starts the collective."""
    done: simpy.Event
    """Fires when the collective completes."""


class Events(dict):
    """A rank's op -> completion event, made when first waited for (``Calls._event_of``) or
    fired (``fire_op``): most ops others wait for end before anyone waits, and then need no
    event of their own. A collective's is its rendezvous event unless the compute walk times
    it (``inline``)."""

    def __init__(self, inline: dict | None, done: simpy.Event):
        super().__init__()
        self.inline, self.done = inline or {}, done


def ended(env: simpy.Environment) -> simpy.Event:
    """A processed event (what ``fire`` leaves of an event nobody waited for): stands for
    every op that ended before anyone waited for it (``fire_op``)."""
    ev = env.event()
    ev._ok, ev._value, ev.callbacks = True, None, None
    return ev


def fire_op(evs: Events, i: int) -> None:
    """Op ``i`` ended now: fire its event, or record it done when nobody waits for it yet."""
    ev = evs.get(i)
    if ev is None:
        evs[i] = evs.done
    else:
        fire(ev)


def fire(ev: simpy.Event) -> None:
    """Succeed ``ev`` now. An event nobody waits for yet is marked processed at once rather
    than queued (a step of the loop that would call no callback): a later waiter finds it
    done, as it would after the step."""
    if ev.callbacks:
        ev.succeed()
    else:
        ev._ok, ev._value, ev.callbacks = True, None, None


@dataclass(slots=True)
class P2PPair:
    """A send/recv pair waiting for its two sides."""

    waiters: list
    """(src, dst, op, callback) of the sides that have reached it, each called when its
    transfer completes (it starts at two, or at one when the peer is folded: SendRecv)."""


class Structure(NamedTuple):
    """What every rank of one program template shares (twin/sim/walks.py)."""

    streams: dict[str, list[int]]
    """Stream -> indices of its ops in order (memory ops excluded)."""
    base_s: list[float]
    """Per op: compute time before straggler, jitter and overlap factors (0 for the rest)."""
    host: object = None
    """The host's plan (twin.sim.host.HostPlan): issue times and sync points; None when
    the host neither costs nor waits."""
    is_compute: list[bool] = []
    """Per op: a compute op (Op.is_compute)."""
    memory: list[int] = []
    """Memory ops (stream mem), in program order."""
    charged: dict = {}
    """Ranks on CPU cores: compute op -> the host time of the calls its thread issues before
    it (twin.sim.thread.Charge), already in its ``base_s``."""
