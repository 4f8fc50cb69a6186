"""The numbers users quote, computed from a trace: the same code for the twin and the executor.

step time, tokens/s, TFLOP/s per GPU, MFU (PaLM's definition: model FLOPs per second over
peak, Chowdhery et al. 2022, App. B), compute and idle time per rank, communication not
hidden behind compute (exposed) per group, the pipeline bubble, and peak memory per rank.
"""

from __future__ import annotations

import statistics
from collections import defaultdict

import numpy as np

from twin.spec import Job
from twin.summary import Summary
from twin.trace import Span, Trace
from twin.vocab import COMPUTE_KINDS, MEMORY_CATEGORIES, MEMORY_KINDS, PIPELINE_PHASES
from twin.workload.flops import model_flops_per_step

COMPUTE = COMPUTE_KINDS
MEMORY = MEMORY_KINDS


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by possibly overlapping intervals."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def _merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def exposed_length(comm: list[tuple[float, float]], compute: list[tuple[float, float]]) -> float:
    """Length of ``comm`` time not covered by ``compute`` time."""
    c, busy = _merge(comm), _merge(compute)
    total, j = 0.0, 0
    for a, b in c:
        covered = 0.0
        while j < len(busy) and busy[j][1] <= a:
            j += 1
        k = j
        while k < len(busy) and busy[k][0] < b:
            covered += min(b, busy[k][1]) - max(a, busy[k][0])
            k += 1
        total += (b - a) - covered
    return total


def peak_memory(spans: list[Span]) -> float:
    """Peak live bytes of one rank in one step (frees before allocs at the same instant)."""
    events = sorted((s.start_us, 0 if s.kind == "free" else 1, s.bytes)
                    for s in spans if s.kind in MEMORY)
    live = peak = 0.0
    for _, is_alloc, nbytes in events:
        live += nbytes if is_alloc else -nbytes
        peak = max(peak, live)
    return peak


def live_series(spans: list[Span]) -> tuple[np.ndarray, list[str], np.ndarray]:
    """Times (us), categories, and live bytes per category after each instant (one rank)."""
    events = sorted((s.step, s.start_us, 0 if s.kind == "free" else 1, s.category or "other",
                     s.bytes) for s in spans if s.kind in MEMORY_KINDS)
    cats = sorted({e[3] for e in events}, key=lambda c: (
        MEMORY_CATEGORIES.index(c) if c in MEMORY_CATEGORIES else 99, c))
    col = {c: i for i, c in enumerate(cats)}
    live = np.zeros(len(cats))
    times: list[float] = []
    rows: list[np.ndarray] = []
    step = None
    for k, t, is_alloc, cat, nbytes in events:
        if k != step:
            if step is not None:  # the step ends: everything is released
                times.append(t)
                rows.append(np.zeros(len(cats)))
            step, live = k, np.zeros(len(cats))
        live[col[cat]] += nbytes if is_alloc else -nbytes
        if times and times[-1] == t:
            rows[-1] = live.copy()
        else:
            times.append(t)
            rows.append(live.copy())
    values = np.array(rows).reshape(len(rows), len(cats))
    return np.array(times), cats, np.clip(values, 0, None)


def step_stats(spans: list[Span]) -> dict:
    """Per-step figures of one step's spans (all ranks present in the trace)."""
    timed = [s for s in spans if s.kind not in MEMORY]
    if not timed:
        raise ValueError("the trace has no timed spans for this step")
    start = min(s.start_us for s in timed)
    end = max(s.end_us for s in timed)
    step_us = end - start
    ranks = sorted({s.rank for s in spans})
    # the pipeline's window: first forward to last backward compute over all ranks
    pipe = [s for s in timed if s.kind in COMPUTE and s.phase in PIPELINE_PHASES]
    w0 = min((s.start_us for s in pipe), default=start)
    w1 = max((s.end_us for s in pipe), default=end)
    compute, idle, mem = {}, {}, {}
    exposed: dict[str, dict[int, float]] = defaultdict(dict)
    bubble = {}
    by_rank: dict[int, list[Span]] = defaultdict(list)
    for s in timed:
        by_rank[s.rank].append(s)
    mem_by_rank: dict[int, list[Span]] = defaultdict(list)
    for s in spans:
        if s.kind in MEMORY:
            mem_by_rank[s.rank].append(s)
    for r in ranks:
        mine = by_rank[r]
        busy = [(s.start_us, s.end_us) for s in mine if s.kind in COMPUTE]
        compute[r] = union_length(busy)
        idle[r] = step_us - compute[r]
        groups: dict[str, list[tuple[float, float]]] = defaultdict(list)
        for s in mine:
            if s.kind not in COMPUTE:
                groups[s.group or s.kind].append((s.start_us, s.end_us))
        for g, iv in groups.items():
            exposed[g][r] = exposed_length(iv, busy)
        # bubble: inside the window, time with neither compute nor communication of the
        # forward/backward (p2p waits and the step-end syncs' waits are the bubble)
        clip = [(max(a, w0), min(b, w1)) for a, b in busy if b > w0 and a < w1]
        coll = [(max(s.start_us, w0), min(s.end_us, w1)) for s in mine
                if s.kind not in COMPUTE and s.group != "pp" and s.phase in PIPELINE_PHASES
                and s.end_us > w0 and s.start_us < w1]
        bubble[r] = max(0.0, (w1 - w0) - union_length(clip) - exposed_length(coll, clip))
        mem[r] = peak_memory(mem_by_rank[r])
    return {"step_us": step_us, "compute_us": compute, "idle_us": idle, "exposed_us": exposed,
            "bubble_us": bubble, "peak_memory_bytes": mem}


def summarize(trace: Trace, job: Job, step_times_s: list[float] | None = None) -> Summary:
    """summary.json fields of a trace (median step; p10/p90 over steps).

    ``step_times_s``: the true step times when the trace holds only some ranks (the
    twin records a subset of a large run); otherwise they come from the spans."""
    by_step: dict[int, list[Span]] = defaultdict(list)
    for s in trace.spans:
        by_step[s.step].append(s)
    if not by_step:
        raise ValueError("the trace is empty")
    return summary_of({k: step_stats(v) for k, v in sorted(by_step.items())}, job,
                      step_times_s)


def throughput(job: Job, step_s: float) -> tuple[float, float, float]:
    """(tokens/s, model TFLOP/s per GPU, MFU) of ``job`` at ``step_s`` seconds a step."""
    par, model = job.parallel, job.model
    flops = model_flops_per_step(model, par.global_batch_size)
    world = job.grid.world_size
    return (par.global_batch_size * model.seq_len / step_s, flops / step_s / world / 1e12,
            flops / (step_s * world * job.cluster.gpu.peak_flops(job.peak_dtype)))


def summary_of(stats: dict[int, dict], job: Job,
               step_times_s: list[float] | None = None) -> Summary:
    """The Summary of per-step figures (``step_stats``' dicts by step), as ``summarize``."""
    times = sorted(st["step_us"] for st in stats.values()) if step_times_s is None else \
        sorted(t * 1e6 for t in step_times_s)
    median_step = min(stats, key=lambda k: abs(stats[k]["step_us"] - statistics.median(times)))
    st = stats[median_step]
    step_s = statistics.median(times) / 1e6
    world = job.grid.world_size
    par, model = job.parallel, job.model
    flops = model_flops_per_step(model, par.global_batch_size)
    tokens_per_s, tflops_per_gpu, mfu = throughput(job, step_s)
    tensors = {r: max(s["peak_memory_bytes"].get(r, 0.0) for s in stats.values())
               for r in st["peak_memory_bytes"]}
    extra = overheads(job, tensors)
    mem = {r: t + sum(extra[r].values()) for r, t in tensors.items()}
    ranks = sorted(st["compute_us"])

    def q(p: float) -> float:
        return times[min(len(times) - 1, max(0, round(p * (len(times) - 1))))] / 1e6

    return Summary(
        step_time_s=step_s,
        step_time_p10_s=q(0.1),
        step_time_p50_s=step_s,
        step_time_p90_s=q(0.9),
        steps=len(times),
        tokens_per_s=tokens_per_s,
        tflops_per_gpu=tflops_per_gpu,
        mfu=mfu,
        bubble_fraction=(float(statistics.mean(st["bubble_us"].values())) / st["step_us"]
                            if par.pp > 1 else 0.0),
        exposed_comm_s={g: float(statistics.mean(v.values())) / 1e6
                           for g, v in sorted(st["exposed_us"].items())},
        compute_s={str(r): float(st["compute_us"][r]) / 1e6 for r in ranks},
        idle_s={str(r): float(st["idle_us"][r]) / 1e6 for r in ranks},
        peak_memory_bytes={str(r): float(mem[r]) for r in ranks},
        peak_memory_max_bytes=float(max(mem.values())) if mem else 0.0,
        fits_memory=bool((max(mem.values()) if mem else 0.0) <= job.cluster.hbm_bytes),
        world_size=world,
        model_flops_per_step=flops,
        tokens_per_step=par.global_batch_size * model.seq_len,
        mfu_peak_dtype=job.peak_dtype,
        extra={"peak_memory_overheads_bytes": extra[max(mem, key=mem.get)] if mem else {}},
    )


OVERHEADS = ("temporary", "workspace", "allocator_reserve", "comm_buffers", "cuda_context")
"""What the schedule's alloc/free ops leave out (``twin.workload.memory``): the largest
kernel's transients, cuBLAS workspaces, the caching allocator's reserve, NCCL's buffers and
the CUDA context. A rank's peak memory is its tensors' peak over the step plus these."""


def overheads(job: Job, ranks) -> dict[int, dict[str, float]]:
    """Per rank, the static model's categories beyond the tensors (the same for every rank
    of one pipeline stage, so computed once per stage)."""
    from twin.workload.memory import rank_memory

    by_stage: dict[int, dict[str, float]] = {}
    out = {}
    for r in ranks:
        stage = job.grid.coord(r, "pp")
        if stage not in by_stage:
            m = rank_memory(job, r)
            by_stage[stage] = {k: float(getattr(m, k)) for k in OVERHEADS}
        out[r] = by_stage[stage]
    return out
