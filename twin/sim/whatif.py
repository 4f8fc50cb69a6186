"""What-if options checked against the job: links that exist, stragglers in range, sane factors.

A degraded link names a fabric resource as ``kind:index...`` (``nic_out:0:3`` = node 0's
NIC 3 outbound, ``up:1`` = node 1's uplink). Its kinds and indices are the topology's
(twin/sim/topology.py RESOURCE_INDICES) and whether it exists is asked of the topology
itself (``Topology.resources_for``), so a typo fails here instead of silently simulating
the baseline.

What is legal but changes nothing, or probably not what was meant, warns (ConfigWarning,
one line each): a factor of 1; a straggler factor below 1 (that rank computes faster: the
factor multiplies compute time, 2.0 is half speed) or a degraded factor above 1 (a faster
link: it multiplies bandwidth, 0.5 is half); jitter with a profile that has no noise; a
degraded link that no flow of the simulated job crosses (``warn_idle_links``, after the
first step). A straggler that folding does not simulate is an error: its representative
(the rank simulated for it) gives the same step, since a synchronous step waits for the
slowest copy.
"""

from __future__ import annotations

import math
import numbers
import warnings

from twin.cost import CostModel, default_cost_model
from twin.sim.engine import SimOptions
from twin.sim.records import fold_rep
from twin.sim.topology import RESOURCE_INDICES, Resource, Topology
from twin.spec import ConfigError, ConfigWarning, Job
from twin.spec.errors import raise_if

LINK_FIELD = "whatif.degraded_link"


def link_forms() -> str:
    """Every kind with its indices, e.g. 'nic_out:NODE:NIC, ..., cpu:NODE'."""
    return ", ".join(":".join([kind, *(i.upper() for i in idx)])
                     for kind, idx in RESOURCE_INDICES.items())


def format_link(res: Resource) -> str:
    """The text form of a resource: ("nic_out", 0, 3) -> 'nic_out:0:3'."""
    return ":".join(map(str, res))


def parse_link(text: str) -> tuple:
    """A degraded link's text ('nic_out:0:3', 'up:1') as its fabric resource tuple."""
    head = f"{LINK_FIELD}={text!r}"
    kind, *idx = str(text).strip().split(":")
    names = RESOURCE_INDICES.get(kind)
    if names is None:
        raise ConfigError(f"{head}: {kind!r} is not a link kind; write one of {link_forms()} "
                          "(e.g. nic_out:0:0 = node 0, NIC 0)")
    form = ":".join([kind, *(n.upper() for n in names)])
    if len(idx) != len(names):
        raise ConfigError(f"{head}: {kind} takes {len(names)} "
                          f"{'index' if len(names) == 1 else 'indices'}, got {len(idx)}; "
                          f"write {form} (e.g. {kind}{':0' * len(names)})")
    try:
        return (kind, *(int(i) for i in idx))
    except ValueError:
        raise ConfigError(f"{head}: the indices must be integers; write {form} "
                          f"(e.g. {kind}{':0' * len(names)})") from None


def _span(values: set[int]) -> str:
    lo, hi = min(values), max(values)
    if len(values) == hi - lo + 1:
        return f"{lo}..{hi}" if hi > lo else str(lo)
    return ", ".join(map(str, sorted(values)))


def _existing(kind: str, exist: dict) -> str:
    """What exists of one kind, e.g. 'nodes 0..1, NICs 0..7'."""
    names = RESOURCE_INDICES[kind]
    have = [r for r in exist if r[0] == kind]
    return ", ".join(f"{name}s {_span({r[1 + i] for r in have})}" for i, name in enumerate(names))


def _missing(res: object, exist: dict, job: Job) -> str:
    """Why a degraded link does not name a resource of this job's fabric, and the fix."""
    if not isinstance(res, tuple) or not res or res[0] not in RESOURCE_INDICES:
        return (f"{LINK_FIELD}={res!r} is not a fabric resource; write kind:index... as one of "
                f"{link_forms()} and parse it with twin.sim.whatif.parse_link")
    c = job.cluster
    shape = (f"{c.num_nodes} node(s) x {c.gpus_per_node} GPU(s), "
             f"{c.inter.nics_per_node} NIC(s) per node, intra={c.intra.kind}")
    kind = res[0]
    kinds = sorted({r[0] for r in exist}, key=list(RESOURCE_INDICES).index)
    if kind not in kinds:
        return (f"{LINK_FIELD}={format_link(res)!r}: this cluster ({shape}) has no {kind} "
                f"links; degrade one of its kinds: {', '.join(kinds)}")
    example = format_link(min(r for r in exist if r[0] == kind))
    return (f"{LINK_FIELD}={format_link(res)!r} does not exist on this cluster ({shape}): its "
            f"{kind} links are {_existing(kind, exist)}; pick one of those (e.g. {example})")


def _check_factor(problems: list[str], field: str, value: object, meaning: str) -> bool:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) \
            or not math.isfinite(value) or value <= 0:
        problems.append(f"{field}={value!r} must be a finite number > 0 ({meaning})")
        return False
    return True


def _warn(message: str) -> None:
    warnings.warn(message, ConfigWarning, stacklevel=3)


def check_options(job: Job, options: SimOptions, cost: CostModel | None = None) -> None:
    """Raise one ConfigError naming every what-if that cannot apply to ``job``: degraded
    links its topology lacks, straggler ranks outside 0..world-1 or folded away, factors
    <= 0 or not finite. Warn (ConfigWarning) for what changes nothing or is probably not
    meant (see the module docstring), once nothing is wrong; ``cost``: the profile, for
    jitter's noise."""
    problems: list[str] = []
    notes: list[str] = []  # warned when nothing is wrong
    world = job.grid.world_size
    for rank, factor in options.straggler.items():
        if isinstance(rank, bool) or not isinstance(rank, numbers.Integral) \
                or not 0 <= rank < world:
            problems.append(f"whatif.straggler_rank={rank!r} is out of range; pick a rank in "
                            f"0..{world - 1}")
        elif options.fold in ("dp", "tp", "all") and fold_rep(job, options.fold, rank) != rank:
            rep = fold_rep(job, options.fold, rank)
            problems.append(f"whatif.straggler_rank={rank} is not simulated with "
                            f"fold={options.fold} (rank {rep} is simulated for it); use "
                            f"whatif.straggler_rank={rep} (the same step: a synchronous step "
                            "waits for its slowest copy) or fold=none")
        if _check_factor(problems, "whatif.straggler_factor", factor,
                         "2.0: the straggler computes at half speed"):
            if factor == 1:
                notes.append(f"whatif.straggler_factor=1 leaves whatif.straggler_rank={rank} at full "
                      "speed: the what-if changes nothing; set e.g. whatif.straggler_factor=2.0 "
                      "(half speed)")
            elif factor < 1:
                notes.append(f"whatif.straggler_factor={factor} < 1 makes rank {rank} compute faster "
                      "(the factor multiplies its compute time); for a slower rank use a "
                      "factor > 1, e.g. 2.0 for half speed")
    if options.degraded:
        topo = Topology(job.cluster, job.grid, default_cost_model(job.cluster))
        exist = topo.resources_for(range(world))
        for res, factor in options.degraded.items():
            if not (isinstance(res, tuple) and res in exist):
                problems.append(_missing(res, exist, job))
            if not _check_factor(problems, "whatif.degraded_factor", factor,
                                 "0.5: the link keeps half its bandwidth"):
                continue
            link = format_link(res) if isinstance(res, tuple) else res
            if factor == 1:
                notes.append(f"whatif.degraded_factor=1 leaves {link} at full bandwidth: the what-if "
                      "changes nothing; set e.g. whatif.degraded_factor=0.5 (half)")
            elif factor > 1:
                notes.append(f"whatif.degraded_factor={factor} > 1 makes {link} faster (the factor "
                      "multiplies its bandwidth); for a degraded link use a factor < 1, "
                      "e.g. 0.5 for half")
    if options.jitter and cost is not None and cost.compute_cv <= 0 and cost.comm_cv <= 0:
        notes.append(f"jitter=true changes nothing: profile {cost.name} has no noise (compute_cv and "
              "comm_cv are 0); measure it with `paratwin calibrate` or give calibration= a "
              "profile with compute_cv/comm_cv")
    raise_if(problems)
    for note in notes:
        _warn(note)


def warn_idle_links(sim, options: SimOptions) -> None:
    """After a simulated step: warn for each degraded link no flow crossed (a NIC of a
    single-node job, a link only folded copies use)."""
    for res in options.degraded:
        if res not in sim.fabric.load:
            folded = "" if options.fold == "none" else \
                f" as simulated with fold={options.fold} (fold=none simulates every rank)"
            _warn(f"whatif.degraded_link={format_link(res)} carries no traffic in this job"
                  f"{folded}: the what-if changes nothing; degrade a link its flows cross")
