"""One simulated step: the engine on the representatives' programs, fast-forwarded through a
pipeline's steady state when that is exact (twin/sim/fastforward.py), handed on as per-rank
timelines, its critical path and the work it took."""

from __future__ import annotations

import gc
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from twin.cost import CostModel
from twin.schedule.builder import build_schedule
from twin.schedule.ir import Program
from twin.sim.codes import op_codes
from twin.sim.critical import CriticalPath, critical_path
from twin.sim.engine import SimOptions, Simulation
from twin.sim.fastforward import (
    MULTIPLES,
    PERIODS,
    SHORT,
    Cut,
    expand,
    find_cut,
    period_microbatches,
    reduced_job,
    reduced_microbatches,
    regular,
)
from twin.sim.stats import OpTable, Timeline, op_table
from twin.spec import Job


@contextmanager
def quiet_gc():
    """Keep Python's cyclic collector off the programs while they are simulated: its full
    passes walk every live op (millions) and cost a third of a large run; what the run
    frees is collected afterwards."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            if not gc.get_freeze_count():  # what the run made goes to the oldest generation
                gc.freeze()  # at once, not through a young-generation pass over millions of
                gc.unfreeze()  # live objects (the next full collection still sees them)
            gc.enable()


@dataclass
class StepRun:
    """One step as the summary, the trace and the critical path read it."""

    programs: dict[int, Program]
    """The programs the timelines index (of the reduced job when fast-forwarded)."""
    lines: dict[int, Timeline]
    moved: dict[int, np.ndarray] | None
    """Per rank and timeline entry: micro-batches its op is moved by (fast-forward)."""
    step_s: float
    path: CriticalPath
    events: int
    ops: int
    """Ops of the step over the simulated ranks (the full job's, fast-forwarded or not)."""
    sim: Simulation
    """The (last) engine run, reduced or not."""
    cut: Cut | None = None
    simulated_microbatches: int = 0
    path_exact: bool = True
    """False when an op or the host's issuing on the critical path spans a whole period: each
    period's share of it is missing from the path's parts (the step time is exact)."""


class Stepper:
    """Simulates steps of ``job`` on the classes' representatives (see the module docstring)."""

    def __init__(self, job: Job, cost: CostModel, options: SimOptions,
                 classes: dict[int, list[int]], fast_forward: bool = True,
                 progress: Callable | None = None):
        self.job, self.cost, self.options, self.classes = job, cost, options, classes
        self.fast_forward = fast_forward
        self.progress = progress
        self._programs: dict[int, dict[int, Program]] = {}  # micro-batches -> programs
        self._tables: dict[int, tuple[list, OpTable]] = {}
        self._copies: dict = {}  # (fastforward.copies_of)
        self.on_engine: Callable[[Simulation], None] | None = None
        """Called with each engine before it runs (progress reports)."""
        self.label = "step 1/1"
        """What the progress reports call the step being simulated."""

    def programs(self, job: Job) -> dict[int, Program]:
        m = job.parallel.num_microbatches
        out = self._programs.get(m)
        if out is None:
            schedule = build_schedule(job)
            out = {}
            for k, r in enumerate(sorted(self.classes)):
                out[r] = schedule.program(r)
                if self.progress:
                    self.progress(k + 1, len(self.classes), "building programs")
            self._programs = {m: out}  # one job's programs at a time
            self._tables = {}  # (and their tables and counterparts: the old ops lists go
            self._copies = {}  # with them)
        return out

    def table(self, prog: Program) -> OpTable:
        """The program's OpTable, shared by the ranks of a template (their ops differ only in
        global ranks); a program without one keys it by its ops list, held with the table so
        that its id cannot be reused by another list meanwhile."""
        key = id(prog.ops) if prog.template is None else prog.template
        hit = self._tables.get(key)
        if hit is None or (hit[0] is not prog.ops if prog.template is None
                           else len(hit[1].compute) != len(prog.ops)):
            hit = self._tables[key] = (prog.ops, op_table(prog.ops, op_codes(prog)))
        return hit[1]

    def _engine(self, job: Job, options: SimOptions) -> Simulation:
        programs = self.programs(job)
        self._say(f"setting up {self.label}")  # the fabric's resources: a pass over every rank
        sim = Simulation(job, programs, self.cost, options, self.classes)
        if self.on_engine:
            self.on_engine(sim)
        sim.run()
        return sim

    def step(self, k: int) -> StepRun:
        """Step ``k`` (its jitter's seed is the options' seed + k)."""
        options = SimOptions(**{**self.options.__dict__, "seed": self.options.seed + k})
        events = 0
        with quiet_gc():
            d = period_microbatches(self.job) if self.fast_forward else None
            m = self.job.parallel.num_microbatches
            tried: set[int] = set()
            for periods in (SHORT, PERIODS, 2 * PERIODS) if d else ():
                m_r = reduced_microbatches(self.job, periods)
                if 2 * m_r > m:  # no time saved: fewer periods, else the full job
                    m_r = reduced_microbatches(self.job, 2)
                if 2 * m_r > m:
                    break
                if m_r in tried:
                    continue
                small = reduced_job(self.job, m_r)
                if periods == SHORT and not regular(self.programs(small), d, m_r, self._copies):
                    continue  # no steady state in so short a run: the next is longer (or, cut
                    # to two periods, the same run tried without this check)
                tried.add(m_r)
                sim = self._engine(small, options)
                events += sim.events + sim.fabric.flows_done
                self._say(f"finding the steady state of {self.label}")
                for period in (j * d for j in range(1, MULTIPLES + 1)):
                    if (m - m_r) % period:
                        continue  # its periods would not fit whole
                    found = find_cut(sim, period, lambda r, sim=sim: sim.structure_of(r).host,
                                     self._copies)
                    if found is not None:
                        cut = Cut(found[0], found[1], (m - m_r) // period, period)
                        return self._forwarded(sim, cut, events, m_r)
            sim = self._engine(self.job, options)
            events += sim.events + sim.fabric.flows_done
            lines = {r: Timeline(self.table(p), np.arange(len(p.ops)), sim.start[r], sim.end[r])
                     for r, p in sim.programs.items()}
            step = max((float(e.max()) for e in sim.end.values() if len(e)), default=0.0)
            self._say(f"critical path of {self.label}")
            path = critical_path(sim, self._p2p_latency_s())
            return StepRun(sim.programs, lines, None, step, path, events,
                           sum(len(p.ops) for p in sim.programs.values()), sim,
                           simulated_microbatches=m)

    def _say(self, what: str) -> None:
        """Report a stage of the step that has no count of its own."""
        if self.progress:
            self.progress(0, None, what)

    def _p2p_latency_s(self) -> float:
        return (self.cost.p2p_latency_us or 0.0) * 1e-6

    def _forwarded(self, sim: Simulation, cut: Cut, events: int, m_r: int) -> StepRun:
        self._say(f"adding {cut.periods} steady period(s) to {self.label}")
        lines, moved = {}, {}
        for r, p in sim.programs.items():
            lines[r], moved[r] = expand(self.table(p), sim.start[r], sim.end[r], cut)
        reduced = max(float(e.max()) for e in sim.end.values() if len(e))
        window = (cut.cut_s - cut.period_s, cut.cut_s)
        self._say(f"critical path of {self.label}")
        path = critical_path(sim, self._p2p_latency_s(), window)
        exact = path.period.exact
        path = path.plus(path.period.path, cut.periods)
        ops = sum(len(ln.idx) for ln in lines.values())
        return StepRun(sim.programs, lines, moved, reduced + cut.periods * cut.period_s, path,
                       events, ops, sim, cut, m_r, exact)

