"""The planner's entry point: a job's schedule, one program per stage translated to every rank.

``build_schedule`` picks the program builder (twin/schedule/step.py: the passes of TP,
recomputation, DDP/ZeRO, FSDP and PP; twin/schedule/legacy.py: nn.DataParallel) and
builds each stage's program once, deriving the other ranks' by translation on the grid.
Under expert parallelism only the shifts that map expert groups onto expert groups
(``symmetric_shifts``) translate one rank's program into another's.
"""

from __future__ import annotations

from dataclasses import replace
from math import gcd, prod
from typing import NamedTuple

from twin.schedule.ir import Program, Schedule
from twin.schedule.legacy import legacy_dp_program
from twin.schedule.step import StepBuilder, build_program
from twin.spec import Job
from twin.spec.experts import STAGE_DIMS, has_expert_groups
from twin.workload.context import programs_differ
from twin.workload.moe import even_routing

__all__ = ["Shift", "StepBuilder", "TemplateBuilder", "build_program", "build_schedule",
           "shifted", "symmetric_shifts"]


def build_schedule(job: Job) -> Schedule:
    """A schedule whose programs are built per rank on demand."""
    if job.parallel.legacy_dp:
        return Schedule(job, builder=legacy_dp_program)
    return Schedule(job, builder=TemplateBuilder(job))


class Shift(NamedTuple):
    """Moves along one digit of grid axis ``axis``: its coordinate a read as digits, this one
    (a // step) mod size, rotated modulo ``size`` while the others stay; ``stride`` global
    ranks per position. A rank's position along it is rank // stride mod size."""

    axis: str
    step: int
    size: int
    stride: int

    def value(self, rank: int) -> int:
        """``rank``'s position along the shift (0: the representatives')."""
        return rank // self.stride % self.size


def symmetric_shifts(job: Job) -> dict[str, tuple[Shift, ...]]:
    """Per foldable axis (dp, tp), the shifts along it that map every rank's program onto
    another rank's (each group onto a group of its kind, the same token counts). Dense
    plans: the whole axis (legacy DP's device 0 differs: dp has none).

    Expert groups (twin/spec/experts.py) read a pipeline stage's index i as the digits
    (etp, ep, edp) of radices (etp, ep, edp); the axis's coordinate a is the digit of i at
    place value p (the sizes of the stage axes inside it). The digit of a between steps q1
    and q2 (q1 | q2 | n) lies inside expert digit [lo, hi) when lo divides p q1 and p q2
    divides hi: rotating it moves i by multiples of lo inside a block of hi, so it changes
    that expert coordinate alone and every expert group maps onto one of its kind (each group
    of a program spans a digit or is constant on it). A shift inside the ep digit moves a
    rank to another EP rank: allowed only when every EP rank sends, receives and computes the
    same (twin.workload.moe.even_routing); etp and edp peers always route alike."""
    grid, par, model = job.grid, job.parallel, job.model
    out: dict[str, tuple[Shift, ...]] = {}
    expert = has_expert_groups(model, par)
    for axis in ("dp", "tp"):
        n = grid.size(axis)
        if n == 1 or (axis == "dp" and par.legacy_dp):
            continue
        if not expert and axis == "dp" and grid.dp_shard not in (None, n):  # HSDP: its digits
            stride, shard = grid.rank(dp=1), grid.dp_shard  # (a rotation of the whole axis
            out[axis] = tuple(s for s in (Shift("dp", 1, shard, stride),  # moves shard groups
                                          Shift("dp", shard, n // shard, stride * shard))
                              if s.size > 1)  # onto no shard group)
        elif not expert:
            out[axis] = (Shift(axis, 1, n, grid.rank(**{axis: 1})),)
        elif not (axis == "dp" and grid.dp_shard not in (None, n)):  # HSDP: not modelled
            shifts = _expert_shifts(job, axis)
            if axis == "tp" and par.async_tp:  # its send/recv ring is in tp order: only a
                shifts = tuple(s for s in shifts if s.size == n)  # whole rotation keeps it
            if shifts:
                out[axis] = shifts
    return out


def _expert_shifts(job: Job, axis: str) -> tuple[Shift, ...]:
    """The digits of ``axis`` that stay inside one expert digit (symmetric_shifts)."""
    grid, par, model = job.grid, job.parallel, job.model
    inner = [d for d in grid.order if d in STAGE_DIMS]  # the stage's axes, innermost first
    n, place = grid.size(axis), prod(grid.size(d) for d in inner[:inner.index(axis)])
    stage = prod(grid.size(d) for d in inner)
    etp, block = par.expert_tp, par.expert_tp * par.ep
    tokens = par.micro_batch_size * (model.seq_len // par.cp) // (par.tp if par.sp else 1)
    digits = [(1, etp), (block, stage)]
    if even_routing(model, tokens, par.ep):
        digits.insert(1, (etp, block))
    out = []
    for lo, hi in digits:
        q1 = lo // gcd(lo, place)
        q2 = gcd(n, hi // place) if hi % place == 0 else 1
        if q2 % q1 == 0 and q2 > q1:
            out.append(Shift(axis, q1, q2 // q1, grid.rank(**{axis: 1}) * q1))
    return tuple(out)


def shifted(shifts: tuple[Shift, ...], source: int, target: int):
    """The map that moves any rank as ``source`` moves to ``target`` along ``shifts`` (each
    position rotated modulo its size, the rest of the rank kept)."""
    delta = [(s, s.value(target) - s.value(source)) for s in shifts]

    def move(m: int) -> int:
        for s, d in delta:
            v = s.value(m)
            m += ((v + d) % s.size - v) * s.stride
        return m

    return move


class TemplateBuilder:
    """Builds one program per pipeline stage and derives the other ranks' by translation.

    All ranks of a stage run the same ops; only the global ranks inside them differ (under
    CP where its ranks' programs differ, twin.workload.context.programs_differ, one template
    per stage and CP rank). A rank's program is its stage template with every group, peer
    and root moved by the rank's offset on the grid (coordinates shifted modulo each axis),
    groups re-sorted into the grid's canonical (ascending) order. Compute and memory ops are
    shared. Under expert parallelism a template stands for the ranks its symmetric shifts
    reach (symmetric_shifts; none: every rank is built); its key is the rank they reach it
    from (position 0 along each)."""

    def __init__(self, job: Job):
        self.job = job
        self.templates: dict[int | tuple[int, int], Program] = {}
        self.by_cp = programs_differ(job.parallel)
        self.shifts = tuple(s for axis in symmetric_shifts(job).values() for s in axis) \
            if has_expert_groups(job.model, job.parallel) else None

    def __call__(self, job: Job, rank: int) -> Program:
        grid = job.grid
        stage = grid.coord(rank, "pp")
        if self.shifts is not None:
            key = ("expert", rank - sum(s.value(rank) * s.stride for s in self.shifts))
        else:
            key = (stage, grid.coord(rank, "cp")) if self.by_cp else stage
        t = self.templates.get(key)
        if t is None:
            t = self.templates[key] = build_program(job, rank)
            t.template = rank
            return t
        if t.rank == rank:
            return t
        if self.shifts is None:
            shift = grid.mover(t.rank, rank)
        else:  # only along the symmetric shifts: expert groups onto expert groups
            shift = shifted(self.shifts, t.rank, rank)
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
        return Program(rank, ops, template=t.rank, blocks=t.blocks)
