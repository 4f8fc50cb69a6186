"""Memory pruning: a plan's peak device memory as `paratwin inspect` gives it, in fewer calls.

The peak is the largest ``twin.workload.memory.rank_memory(job, rank).total`` over the
first rank of every pipeline stage (what ``inspect`` lists and ``fits_memory`` holds
against HBM): model states per ZeRO stage, activations of the micro-batches in flight,
FSDP buffers, the largest transient, workspaces, the allocator's reserve, NCCL buffers
and the CUDA context (the overheads ``paratwin simulate`` adds to the tensors' peak).

With an even split only three stages can hold the peak: the first (embedding), the last
(head and loss) and the second, which dominates every stage between it and the last:
those hold the same parameters, transients and communicators, and the micro-batches in
flight never grow with the stage index (GPipe m; 1F1B min(m, p - i); interleaved
Megatron's warm-up, decreasing in i), so neither do their activations nor the
allocator's reserve. An uneven split (``pp_stage_layers``) and the split-backward tables
(ZB-H1, ZB-V, DualPipeV, CSV: in flight walked on the table, the V's head on rank 0)
check every stage.
"""

from __future__ import annotations

from dataclasses import dataclass

from twin.spec import Job
from twin.workload.memory import (
    Memory,
    activation_bytes_per_layer,
    inflight_microbatches,
    model_state_bytes,
    rank_memory,
)
from twin.workload.params import stage_params


@dataclass(frozen=True)
class SearchJob(Job):
    """A Job that lists each stage's layers once: the memory model asks for them often
    (the same figures as Job, computed once per stage)."""

    def layers_on_stage(self, stage: int) -> tuple[int, ...]:
        cache = self.__dict__.setdefault("_layers_on_stage", {})
        hit = cache.get(stage)
        if hit is None:
            hit = cache[stage] = Job.layers_on_stage(self, stage)
        return hit


@dataclass(frozen=True)
class Peak:
    """The largest per-rank memory of a plan and where it is."""

    total_bytes: float
    stage: int
    memory: Memory

    def fits(self, hbm_bytes: float) -> bool:
        return self.total_bytes <= hbm_bytes


def peak_stages(job: Job) -> list[int]:
    """The pipeline stages whose first rank can hold the plan's peak (module docstring)."""
    p, par = job.parallel.pp, job.parallel
    if par.pp_stage_layers is not None or par.pp_schedule in ("zb_h1", "zb_v", "dualpipev") \
            or par.pp_schedule_csv is not None:  # tables walked: no monotone in-flight count
        return list(range(p))
    return sorted({0, min(1, p - 1), p - 1})


def lower_bound(job: Job) -> float:
    """Bytes the first stage holds at least: its model states and its layers' activations for
    the micro-batches in flight (parts of ``rank_memory``'s total, so a plan whose bound
    exceeds the HBM cannot fit; a cheap first cut before ``peak_memory``)."""
    par, model = job.parallel, job.model
    states = model_state_bytes(stage_params(job, 0), par.shard_degree, par.zero_stage, model.dtype,
                               par.optimizer_dtype)
    per_layer = activation_bytes_per_layer(model, par.micro_batch_size, par.tp, par.sp,
                                           par.recompute, par.flash_attention)
    acts = per_layer * len(job.layers_on_stage(0)) * inflight_microbatches(job, 0)
    return states.params + states.grads + states.optimizer + acts


def peak_memory(job: Job) -> Peak:
    """The plan's peak device memory per rank (``inspect``'s figure, see the docstring)."""
    best: Peak | None = None
    for stage in peak_stages(job):
        mem = rank_memory(job, job.grid.rank(pp=stage))
        if best is None or mem.total > best.total_bytes:
            best = Peak(mem.total, stage, mem)
    assert best is not None
    return best
