"""The planner's entry point: a job's schedule, one program per stage translated to every rank.

``build_schedule`` picks the program builder (twin/schedule/step.py: the passes of TP,
recomputation, DDP/ZeRO, FSDP and PP; twin/schedule/legacy.py: nn.DataParallel) and
builds each stage's program once, deriving the other ranks' by translation on the grid.
"""

from __future__ import annotations

from dataclasses import replace

from twin.schedule.ir import Program, Schedule
from twin.schedule.legacy import legacy_dp_program
from twin.schedule.step import StepBuilder, build_program
from twin.spec import Job
from twin.spec.experts import has_expert_groups
from twin.workload.context import programs_differ

__all__ = ["StepBuilder", "TemplateBuilder", "build_program", "build_schedule"]


def build_schedule(job: Job) -> Schedule:
    """A schedule whose programs are built per rank on demand."""
    if job.parallel.legacy_dp:
        return Schedule(job, builder=legacy_dp_program)
    if has_expert_groups(job.model, job.parallel):  # MoE: expert groups, uneven routing
        return Schedule(job, builder=build_program)
    return Schedule(job, builder=TemplateBuilder(job))


class TemplateBuilder:
    """Builds one program per pipeline stage and derives the other ranks' by translation.

    All ranks of a stage run the same ops; only the global ranks inside them differ (under
    CP where its ranks' programs differ, twin.workload.context.programs_differ, one template
    per stage and CP rank). A rank's program is its stage template with every group, peer
    and root moved by the rank's offset on the grid (coordinates shifted modulo each axis),
    groups re-sorted into the grid's canonical (ascending) order. Compute and memory ops are
    shared."""

    def __init__(self, job: Job):
        self.job = job
        self.templates: dict[int | tuple[int, int], Program] = {}
        self.by_cp = programs_differ(job.parallel)

    def __call__(self, job: Job, rank: int) -> Program:
        grid = job.grid
        stage = grid.coord(rank, "pp")
        key = (stage, grid.coord(rank, "cp")) if self.by_cp else stage
        t = self.templates.get(key)
        if t is None:
            t = self.templates[key] = build_program(job, rank)
            t.template = rank
            return t
        if t.rank == rank:
            return t
        shift = grid.mover(t.rank, rank)
        memo: dict[int, int] = {}

        def move(m: int) -> int:
            if m < 0:
                return m
            r = memo.get(m)
            if r is None:
                r = memo[m] = shift(m)
            return r

        groups: dict[tuple, tuple] = {}
        ops = []
        for op in t.ops:
            if op.group or op.peer >= 0 or op.root >= 0:
                g = groups.get(op.group)
                if g is None:
                    g = groups[op.group] = tuple(sorted(move(m) for m in op.group))
                op = replace(op, group=g, root=move(op.root), peer=move(op.peer))
            ops.append(op)
        return Program(rank, ops, template=t.rank)
