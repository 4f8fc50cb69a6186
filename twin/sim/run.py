"""simulate(): build the programs, run the engine for N steps, and write spans and summary."""

from __future__ import annotations

import time
from dataclasses import dataclass

from twin.cost import CostModel, default_cost_model
from twin.metrics import summarize
from twin.schedule.builder import build_schedule
from twin.sim.engine import SimOptions, Simulation, fold_classes
from twin.sim.whatif import check_options
from twin.spec import Job
from twin.spec.io import job_to_dict
from twin.summary import Summary
from twin.trace import Span, Trace

MAX_TRACE_SPANS = 2_000_000


@dataclass
class SimResult:
    trace: Trace
    summary: Summary


def simulate(job: Job, cost: CostModel | None = None, options: SimOptions | None = None,
             steps: int = 1, progress=None) -> SimResult:
    """Simulate ``steps`` steps of ``job`` (independent draws when jitter is on).

    ``progress(done, total, what)`` reports building and simulating. The trace holds every simulated
    rank unless that would exceed MAX_TRACE_SPANS spans, in which case it holds the
    first simulated rank of each pipeline stage (the summary still covers all ranks'
    step time). What-ifs that cannot apply to ``job`` (a link its topology lacks, a
    straggler outside the world) raise ConfigError (twin.sim.whatif.check_options)."""
    t0 = time.perf_counter()
    cost = cost or default_cost_model(job.cluster)
    options = options or SimOptions()
    check_options(job, options)
    classes = fold_classes(job, options.fold)
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
    for k in range(steps):
        opts = SimOptions(**{**options.__dict__, "seed": options.seed + k})
        sim = Simulation(job, programs, cost, opts, classes)
        if progress:
            timed = n_ops - mem_ops
            sim.on_progress = lambda done, k=k, timed=timed: progress(k * timed + done, steps * timed,
                                                         f"simulating step {k + 1}/{steps}")
        step = sim.run()
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
        "profile": cost.name, "jitter": options.jitter, "seed": options.seed})
    return SimResult(trace, summary)
