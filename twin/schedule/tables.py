"""A job's pipeline tables: a named schedule's (pipeline.py, zerobubble.py) or a CSV file's."""

from __future__ import annotations

from collections import Counter
from functools import lru_cache

from twin.schedule import zerobubble
from twin.schedule.pipeline import SPLIT_SCHEDULES, Action, peak_in_flight, stage_order
from twin.schedule.torchcsv import load_table
from twin.spec import Job


def stage_table(schedule: str, p: int, m: int, stage: int, v: int = 1) -> list[Action]:
    """The action table of one stage for any named schedule (``ParallelPlan.pp_schedule``)."""
    if schedule in SPLIT_SCHEDULES:
        return getattr(zerobubble, schedule)(p, m, stage)
    return stage_order(schedule, p, m, stage, v)


def job_tables(job: Job) -> list[list[Action]]:
    """Every pipeline rank's table: the pp_schedule_csv file's, or pp_schedule's."""
    par = job.parallel
    if par.pp_schedule_csv is not None:
        return load_table(par.pp_schedule_csv, par.pp, par.num_stages).orders
    return [stage_table(par.pp_schedule, par.pp, par.num_microbatches, s, par.pp_virtual_stages)
            for s in range(par.pp)]


def inflight(job: Job, stage: int) -> tuple[float, int] | None:
    """(micro-batches of the stage's whole layer count, head micro-batches) whose
    activations the stage holds at its peak, walked on its table (pipeline.peak_in_flight:
    a forward adds a chunk, its B or W releases it); None for gpipe, 1f1b and interleaved
    (closed forms in twin.workload.memory)."""
    par = job.parallel
    if par.pp_schedule_csv is None and par.pp_schedule not in SPLIT_SCHEDULES:
        return None
    if par.pp_schedule_csv is None:  # a named table: walked once per shape (searches ask often)
        return _named_inflight(par.pp_schedule, par.pp, par.num_microbatches, stage,
                               par.pp_virtual_stages)
    order = job_tables(job)[stage]
    last = job.parallel.num_stages - 1
    return (peak_in_flight(order) / job.parallel.pp_virtual_stages,
            peak_in_flight([a for a in order if a.chunk == last]))


@lru_cache(maxsize=65536)
def _named_inflight(schedule: str, p: int, m: int, stage: int, v: int) -> tuple[float, int]:
    order = stage_table(schedule, p, m, stage, v)
    return peak_in_flight(order) / v, peak_in_flight([a for a in order if a.chunk == p * v - 1])


@lru_cache(maxsize=4096)
def _named_table(schedule: str, p: int, m: int, stage: int, v: int) -> tuple[Action, ...]:
    return tuple(stage_table(schedule, p, m, stage, v))


def held_layer_bytes(job: Job, stage: int, kept: float, recomputed: float) -> float:
    """Peak bytes of the stage's layers' activations walked on its table: a chunk's forward
    keeps ``kept`` per layer until its B or W; under a split backward with full
    recomputation its I re-creates ``recomputed`` per layer, held until its W (the weight
    gradients need them)."""
    layers = Counter(_chunk_of(job, layer) for layer in job.layers_on_stage(stage))
    live = peak = 0.0
    par = job.parallel
    table = job_tables(job)[stage] if par.pp_schedule_csv is not None else _named_table(
        par.pp_schedule, par.pp, par.num_microbatches, stage, par.pp_virtual_stages)
    for a in table:
        n = layers.get(a.chunk, 0)
        if a.phase == "F":
            live += kept * n
        elif a.phase == "I":
            live += recomputed * n
        elif a.phase in ("B", "W"):
            live -= (kept + (recomputed if a.phase == "W" else 0.0)) * n
        peak = max(peak, live)
    return peak


def _chunk_of(job: Job, layer: int) -> int:
    """The model chunk holding global layer ``layer``."""
    end = 0
    for c, n in enumerate(job.stage_layers):
        end += n
        if layer < end:
            return c
    raise ValueError(f"layer {layer} is past the model's {end} layers")
