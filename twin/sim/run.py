"""simulate(): settle the options (fold=auto, fast-forward), check the work against a budget,
run the engine for N steps (twin/sim/stepsim.py), and hand back the summary of every
simulated rank and the spans the trace level asks for (twin/sim/spans.py).

The budget (``check_budget``) is checked from the job's shape before anything is built per
rank: a mistyped ``cluster.num_nodes=10000000`` or ten million micro-batches is refused in
one line with the estimate, the budget and the fix, instead of running for hours.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

from twin.cost import CostModel, default_cost_model
from twin.metrics import summary_of
from twin.sim.engine import SimOptions, fold_classes
from twin.sim.records import auto_fold, exact_axes, folded_axes, folded_shifts, unfolded_note
from twin.sim.spans import TRACE_LEVELS, rank_spans, recorded_ranks
from twin.sim.stats import step_figures
from twin.sim.stepsim import Stepper, StepRun, quiet_gc
from twin.sim.whatif import check_options, warn_idle_links
from twin.spec import ConfigError, Job
from twin.spec.io import job_to_dict
from twin.summary import Summary
from twin.trace import Span, Trace

MAX_TRACE_SPANS = 2_000_000
"""Spans the library's default trace holds at most (every simulated rank's, else the
report's level of detail); the CLI asks for a level (``trace=``)."""

MAX_RANKS = 1 << 18
"""GPUs (ranks) the twin sets up at most, folded or not: folding, the fabric and the
collectives' groups walk every rank. 262,144 is 16x the largest documented job (16,384
GPUs, benchmarks/bench_twin.py (c)); its setup takes about a second."""
MAX_WORK = 50_000_000
"""Work units (estimate_work: ops simulated, collective members planned and laid out) the
twin takes on at most. A unit costs 5 to 25 us on one core, so the budget is minutes of
work: it refuses runaway inputs, not big jobs. The documented jobs are well under it:
bench_twin.py (b) (1,024 GPUs unfolded, about a minute) is 8.2 million units, (c) (16,384
GPUs folded, seconds) 0.4 million; auto folding (every exact copy simulated once) keeps
thousands of GPUs in seconds (8,192 GPUs of Llama-3 8B FSDP: 0.8 million)."""
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
    fold_of = {"dp": 1, "tp": 1}
    for shift in folded_shifts(job, fold):  # the whole axis, or digits of it (MoE)
        fold_of[shift.axis] *= shift.size
    simulated = grid.world_size // (fold_of["dp"] * fold_of["tp"])
    m = p.num_microbatches
    layers = max(len(job.layers_on_stage(s)) for s in range(p.pp))
    syncs = m if p.sync_every_microbatch else 1
    per_layer = (3 if p.zero_stage == 3 else 6) * syncs + (6 if p.zero_stage in (1, 2) else 0)
    dp_colls = 0 if grid.size("dp") == 1 else layers * per_layer
    tp_colls = 0 if p.tp == 1 else TP_COLLECTIVES_PER_LAYER * layers * m
    members = simulated * (dp_colls * fold_of["dp"] + tp_colls * fold_of["tp"])
    group = sum(grid.size(d) for d in ("dp", "tp", "pp", "cp") if grid.size(d) > 1)
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
    try:  # legacy DP, or an expert-parallel axis that no shift keeps, cannot fold=all
        folded = estimate_work(job, "all", steps).units
    except ConfigError:
        folded = None
    if fold != "all" and folded is not None and w.world <= MAX_RANKS and folded <= max_work:
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


def resolve_options(job: Job, options: SimOptions, steps: int = 1) \
        -> tuple[SimOptions, list[str]]:
    """``options`` with fold=auto and fast-forward settled for ``job``, and a notice for each
    choice a user may not expect. auto folds every axis whose copies are exact
    (records.exact_axes) unless jitter or a what-if singles ranks out: then every rank is
    simulated, or, past the work budget, the exact axes are folded with a notice that the
    copies share their representative's noise or what-if. Fast-forward is off with jitter
    (no two periods alike) and with what-ifs."""
    notes: list[str] = []
    perturbed = [what for what, on in (("jitter", options.jitter),
                                        ("a straggler", bool(options.straggler)),
                                        ("a degraded link", bool(options.degraded))) if on]
    fold = options.fold
    if fold == "auto":
        fold = auto_fold(job, options.algorithm)
        if perturbed and fold != "none":
            try:
                check_budget(job, "none", steps)
                fold = "none"
                notes.append(f"fold=auto simulates every rank: {' and '.join(perturbed)} "
                             "single(s) out ranks, so no two are copies")
            except ConfigError:
                notes.append(f"fold=auto folds along {fold} despite {' and '.join(perturbed)}: "
                             "every rank is past the work budget; the folded copies share "
                             "their representative's noise and what-ifs")
        note = unfolded_note(job, options.algorithm)  # what stays unfolded, and why
        if note and not (perturbed and fold == "none"):
            notes.append(note)
    elif fold != "none":  # an explicit fold: say where its copies are not exact
        try:
            loose = [a for a in folded_axes(job, fold) if a not in exact_axes(job, options.algorithm)]
        except ConfigError:  # (raised again, with its fix, when the ranks are folded)
            loose = []
        if loose:
            notes.append(f"fold={fold} is approximate along {' and '.join(loose)}: a copy there "
                         "meets other links than the rank simulated for it (fold=auto folds "
                         "only where that is exact)")
    fast = options.fast_forward
    if fast and perturbed:
        fast = False
        notes.append(f"fast-forward is off: {' and '.join(perturbed)} (every micro-batch is "
                     "simulated)")
    return dataclasses.replace(options, fold=fold, fast_forward=fast), notes


def simulate(job: Job, cost: CostModel | None = None, options: SimOptions | None = None,
             steps: int = 1, progress=None, trace: str | None = None) -> SimResult:
    """Simulate ``steps`` steps of ``job`` (independent draws when jitter is on; without it
    every step is the first).

    ``trace``: what the returned trace holds (twin/sim/spans.py): ``full`` every simulated
    rank's spans, ``auto`` what the report draws by default, ``none`` nothing; None (the
    default): full unless that is past MAX_TRACE_SPANS spans, then auto. The summary covers
    every simulated rank whatever the trace holds. ``progress(done, total, what)`` reports
    folding, building, preparing and simulating, and with ``total`` None the stages that have
    no count (the steady state, the critical path, the spans). What-ifs that cannot apply to
    ``job`` (a link its topology lacks, a straggler outside the world) raise ConfigError
    (twin.sim.whatif.check_options), as does a job past the work budget (check_budget); a
    degraded link no flow crossed warns once (twin.sim.whatif.warn_idle_links)."""
    t0 = time.perf_counter()
    cost = cost or default_cost_model(job.cluster)
    if job.parallel.compile:  # torch.compile: elementwise chains fused (CostModel.compiled)
        cost = cost.compiled()
    options, notes = resolve_options(job, options or SimOptions(), steps)
    if trace is not None and trace not in TRACE_LEVELS:
        raise ConfigError(f"trace={trace!r} is not one of {'|'.join(TRACE_LEVELS)}")
    check_budget(job, options.fold, steps)
    check_options(job, options, cost)
    classes = fold_classes(job, options.fold, progress)
    stepper = Stepper(job, cost, options, classes, options.fast_forward, progress)
    first: StepRun | None = None
    stats: dict[int, dict] = {}
    spans: list[Span] = []
    record: list[int] = []
    step_times: list[float] = []
    offset, events, ops, parts, shaped = 0.0, 0, 0, {}, 0.0
    for k in range(steps):
        if first is not None and not options.jitter:
            run = first  # no noise: every step is the first
            stats[k] = stats[0]
        else:
            stepper.label = f"step {k + 1}/{steps}"
            if progress:
                stepper.on_engine = lambda sim, k=k: _report(progress, sim, f"step {k + 1}/{steps}")
            run = stepper.step(k)
            events += run.events
            stats[k] = step_figures(run.lines, offset)
        if first is None:
            first = run
            warn_idle_links(run.sim, options)
            parts = run.path.parts(cost, job.cluster.gpu)
            shaped = run.path.shape_factor_s(cost, job.cluster.gpu)
            record = _recorded(job, run, trace, steps)
        run.sim = None  # the engine's state: done with (its arrays live on in the timelines)
        if progress and record:
            progress(0, None, f"recording the spans of {len(record)} rank(s)")
        with quiet_gc():  # a collection among the new spans would walk every live op
            for r in record:
                spans.extend(rank_spans(r, run.programs[r].ops, run.lines[r], k, offset,
                                        run.moved[r] if run.moved else None))
        step_times.append(run.step_s)
        ops += run.ops
        offset += run.step_s
    wall = time.perf_counter() - t0
    meta_trace = {"level": trace or ("full" if len(record) == len(first.lines) else "auto"),
                  "recorded_ranks": record}
    out = Trace(spans, meta={
        "source": "twin", "world_size": job.grid.world_size,
        "gpus_per_node": job.cluster.gpus_per_node, "job": job_to_dict(job), "steps": steps,
        "fold": options.fold, "simulated_ranks": len(classes), "recorded_ranks": record,
        "profile": cost.name, "trace": meta_trace["level"]})
    summary = summary_of(stats, job, step_times)
    summary.extra.update({
        "source": "twin",
        "simulated_ranks": len(classes), "fold": options.fold, "events": events,
        "wall_s": wall, "events_per_s": events / wall if wall else 0.0,
        "ops": ops,
        "profile": cost.name, "jitter": options.jitter, "seed": options.seed,
        # what the first step's critical path spends its time on: compute per kind, the
        # host issuing ops, collectives, send/recv, waits nothing explains
        "critical_path_s": {key: v for key, v in parts.items() if v > 0},
        # of its compute, what the profile's kernel shape factors add (negative: take off)
        "critical_path_shape_factors_s": shaped,
        "fast_forward": _forwarded(job, first), "trace": meta_trace, "notes": notes})
    return SimResult(out, summary)


def _report(progress, sim, step: str) -> None:
    """Have engine ``sim`` report its ranks' setup and the ops it has simulated (of those its
    stream processes walk: not the sends and recvs, each its own chain, nor memory ops)."""
    total = []

    def simulated(done: int) -> None:
        if not total:  # the ranks' streams are known once the run has started
            total.append(sum(len(idx) for r in sim.programs
                             for s, idx in sim.structure_of(r).streams.items() if s != "p2p"))
        progress(done, total[0], f"simulating {step}")

    sim.on_setup = lambda done, ranks: progress(done, ranks, f"preparing {step}")
    sim.on_progress = simulated


def _recorded(job: Job, run: StepRun, trace: str | None, steps: int) -> list[int]:
    stage_of = {r: job.grid.coord(r, "pp") for r in run.lines}
    timed = {r: int(ln.table.timed[ln.idx].sum()) for r, ln in run.lines.items()}
    if trace is None:
        total = sum(len(ln.idx) for ln in run.lines.values()) * steps
        trace = "full" if total <= MAX_TRACE_SPANS else "auto"
    return recorded_ranks(trace, stage_of, timed, steps)


def _forwarded(job: Job, run: StepRun) -> dict | None:
    """What the fast-forward did (None: every micro-batch was simulated)."""
    if run.cut is None:
        return None
    return {"period_s": run.cut.period_s, "periods": run.cut.periods,
            "period_microbatches": run.cut.period_mb,
            "microbatches": job.parallel.num_microbatches,
            "simulated_microbatches": run.simulated_microbatches,
            "critical_path_exact": run.path_exact}
