"""simulate(): check the work against a budget, build the programs, run the engine for N
steps, and write spans and summary.

The budget (``check_budget``) is checked from the job's shape before anything is built per
rank: a mistyped ``cluster.num_nodes=10000000`` or ten million micro-batches is refused in
one line with the estimate, the budget and the fix, instead of running for hours.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from twin.cost import CostModel, default_cost_model
from twin.metrics import summarize
from twin.schedule.builder import build_schedule
from twin.sim.critical import critical_path
from twin.sim.engine import SimOptions, Simulation, fold_classes
from twin.sim.records import folded_axes
from twin.sim.whatif import check_options, warn_idle_links
from twin.spec import ConfigError, Job
from twin.spec.io import job_to_dict
from twin.summary import Summary
from twin.trace import Span, Trace

MAX_TRACE_SPANS = 2_000_000

MAX_RANKS = 1 << 18
"""GPUs (ranks) the twin sets up at most, folded or not: folding, the fabric and the
collectives' groups walk every rank. 262,144 is 16x the largest documented job (16,384
GPUs, benchmarks/bench_twin.py (c)); its setup takes about a second."""
MAX_WORK = 50_000_000
"""Work units (estimate_work: ops simulated, collective members planned and laid out) the
twin takes on at most. A unit costs 5 to 25 us on one core, so the budget is minutes of
work: it refuses runaway inputs, not big jobs. The documented jobs are well under it:
bench_twin.py (b) (1,024 GPUs unfolded, about a minute) is 8.2 million units, (c) (16,384
GPUs folded, seconds) 0.4 million; auto folding (above 512 GPUs) keeps thousands of GPUs
in seconds (8,192 GPUs of Llama-3 8B FSDP: 0.8 million)."""
OPS_PER_LAYER = 40
"""Ops per layer and micro-batch of one rank's program: 29 to 60 over the presets (more
with TP, SP and recomputation), plus a quarter of that per layer once a step (gradient
buckets, optimizer): the estimate is within a factor of about 2."""
TP_COLLECTIVES_PER_LAYER = 8
"""TP collectives per layer and micro-batch (forward and backward, SP and recompute)."""


@dataclass
class WorkEstimate:
    """What a simulation will cost, from the job's shape alone (nothing built per rank)."""

    world: int
    simulated_ranks: int
    """Ranks simulated after folding."""
    ops_per_rank: int
    """Ops of the largest pipeline stage's program (about)."""
    members: int
    """Collective members planned per step: a collective's flows are planned for its whole
    group, so folding does not shrink it (about)."""
    laid_out: int
    """Group members laid out once: each simulated rank's program moves its stage's
    template groups (dp, tp, pp) to its place on the grid."""
    steps: int

    @property
    def units(self) -> int:
        return self.steps * (self.simulated_ranks * self.ops_per_rank + self.members) \
            + self.laid_out


def estimate_work(job: Job, fold: str = "none", steps: int = 1) -> WorkEstimate:
    """Ranks, ops and collective members of simulating ``job``, in O(pipeline stages)."""
    p, grid = job.parallel, job.grid
    axes = folded_axes(job, fold)
    fold_of = {d: (grid.size(d) if d in axes else 1) for d in ("dp", "tp")}
    simulated = grid.world_size // (fold_of["dp"] * fold_of["tp"])
    m = p.num_microbatches
    layers = max(sum(job.stage_layers[c] for c in range(s, p.num_stages, p.pp))
                 for s in range(p.pp))
    syncs = m if p.sync_every_microbatch else 1
    per_layer = (3 if p.zero_stage == 3 else 6) * syncs + (6 if p.zero_stage in (1, 2) else 0)
    dp_colls = 0 if grid.size("dp") == 1 else layers * per_layer
    tp_colls = 0 if p.tp == 1 else TP_COLLECTIVES_PER_LAYER * layers * m
    members = simulated * (dp_colls * fold_of["dp"] + tp_colls * fold_of["tp"])
    group = sum(grid.size(d) for d in ("dp", "tp", "pp") if grid.size(d) > 1)
    ops = OPS_PER_LAYER * layers * m + OPS_PER_LAYER // 4 * layers  # + the step's own ops
    return WorkEstimate(grid.world_size, simulated, ops, members, simulated * group, steps)


def check_budget(job: Job, fold: str = "none", steps: int = 1,
                 max_work: int = MAX_WORK) -> WorkEstimate:
    """The estimate, or one ConfigError with the estimate, the budget and the fixes."""
    w = estimate_work(job, fold, steps)
    if w.world <= MAX_RANKS and w.units <= max_work:
        return w
    p, c = job.parallel, job.cluster
    fixes = []
    if fold != "all" and not p.legacy_dp and w.world <= MAX_RANKS \
            and estimate_work(job, "all", steps).units <= max_work:
        fixes.append("fold=all (simulates each copy once)")
    if c.num_nodes > 1:
        fixes.append(f"fewer nodes (cluster.num_nodes={c.num_nodes:,})")
    if p.num_microbatches > max(1, p.pp):
        fixes.append(f"fewer micro-batches (parallel.global_batch_size={p.global_batch_size:,} "
                     f"is {p.num_microbatches:,} micro-batches per pipeline)")
    if steps > 1:
        fixes.append(f"fewer steps (steps={steps:,})")
    over = [f"{w.world:,} GPUs (budget {MAX_RANKS:,})"] if w.world > MAX_RANKS else []
    if w.units > max_work:
        ranks = f"{w.simulated_ranks:,} rank{'s' * (w.simulated_ranks > 1)}"
        per = f" x {steps:,} steps" if steps > 1 else ""
        over.append(f"about {_count(w.units)} work units (budget {_count(max_work)}, minutes: "
                    f"{ranks} simulated with fold={fold} x ~{w.ops_per_rank:,} ops{per}, plus "
                    f"~{_count(w.members * steps + w.laid_out)} collective members to lay out)")
    raise ConfigError(f"this job is too big to simulate: {' and '.join(over)}; use "
                      f"{' or '.join(fixes) or 'a smaller job'}")


def _count(n: float) -> str:
    """1234 -> '1,234'; 7.68e9 -> '7.68 billion'."""
    for scale, word in ((1e9, "billion"), (1e6, "million")):
        if n >= scale:
            return f"{n / scale:.3g} {word}"
    return f"{n:,.0f}"


@dataclass
class SimResult:
    trace: Trace
    summary: Summary


def simulate(job: Job, cost: CostModel | None = None, options: SimOptions | None = None,
             steps: int = 1, progress=None) -> SimResult:
    """Simulate ``steps`` steps of ``job`` (independent draws when jitter is on).

    ``progress(done, total, what)`` reports folding, building and simulating. The trace
    holds every simulated rank unless that would exceed MAX_TRACE_SPANS spans, in which case it holds the
    first simulated rank of each pipeline stage (the summary still covers all ranks'
    step time). What-ifs that cannot apply to ``job`` (a link its topology lacks, a
    straggler outside the world) raise ConfigError (twin.sim.whatif.check_options), as
    does a job past the work budget (check_budget); a degraded link no flow crossed
    warns once (twin.sim.whatif.warn_idle_links)."""
    t0 = time.perf_counter()
    cost = cost or default_cost_model(job.cluster)
    options = options or SimOptions()
    check_budget(job, options.fold, steps)
    check_options(job, options, cost)
    classes = fold_classes(job, options.fold, progress)
    schedule = build_schedule(job)
    programs = {}
    for k, r in enumerate(sorted(classes)):
        programs[r] = schedule.program(r)
        if progress and not k % 64:
            progress(k + 1, len(classes), "building programs")
    n_ops = sum(len(p.ops) for p in programs.values())
    mem_ops = sum(1 for p in programs.values() for op in p.ops if op.stream == "mem")
    record = sorted(programs)
    if n_ops * steps > MAX_TRACE_SPANS:
        stage_first: dict[int, int] = {}
        for r in record:
            stage_first.setdefault(job.grid.coord(r, "pp"), r)
        record = sorted(stage_first.values())
    spans: list[Span] = []
    step_times, events = [], 0
    offset = 0.0
    timed = n_ops - mem_ops
    for k in range(steps):
        opts = SimOptions(**{**options.__dict__, "seed": options.seed + k})
        if progress:  # the fabric's resources: one pass over every rank
            progress(k * timed, steps * timed, f"setting up step {k + 1}/{steps}")
        sim = Simulation(job, programs, cost, opts, classes)
        if progress:
            sim.on_progress = lambda done, k=k, timed=timed: progress(k * timed + done, steps * timed,
                                                         f"simulating step {k + 1}/{steps}")
        step = sim.run()
        if not k:
            warn_idle_links(sim, options)
            parts = critical_path(sim, (cost.p2p_latency_us or 0.0) * 1e-6).parts(cost, job.cluster.gpu)
        step_times.append(step)
        events += sim.events + sim.fabric.flows_done
        for r in record:
            st, en = sim.start[r], sim.end[r]
            for i, op in enumerate(programs[r].ops):
                spans.append(Span.of(op, r, k, (offset + st[i]) * 1e6, (offset + en[i]) * 1e6))
        offset += step
    wall = time.perf_counter() - t0
    trace = Trace(spans, meta={
        "source": "twin", "world_size": job.grid.world_size,
        "gpus_per_node": job.cluster.gpus_per_node, "job": job_to_dict(job), "steps": steps,
        "fold": options.fold, "simulated_ranks": len(programs), "recorded_ranks": record,
        "profile": cost.name})
    summary = summarize(trace, job, step_times)
    summary.extra.update({
        "source": "twin",
        "simulated_ranks": len(programs), "fold": options.fold, "events": events,
        "wall_s": wall, "events_per_s": events / wall if wall else 0.0, "ops": n_ops * steps,
        "profile": cost.name, "jitter": options.jitter, "seed": options.seed,
        # what the first step's critical path spends its time on: compute per kind, the
        # host issuing ops, collectives, send/recv, waits nothing explains
        "critical_path_s": {key: v for key, v in parts.items() if v > 0}})
    return SimResult(trace, summary)
