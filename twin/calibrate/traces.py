"""Fit the cost model to the executor's own runs: every measured op in the step where it ran.

A run directory written by ``paratwin execute`` holds the job and every op's span
(``spans.json``). Its measured steps (after the warm-up) become measurements of three kinds:

- **kernels**: the duration of each compute op during which no communication ran on its
  node (the twin adds that contention itself: shared cores on one host, ``overlap_slowdown``
  on a GPU), grouped by what its cost depends on (kind, dtype, shape, the FLOPs it is timed
  by, bytes): the mean and p10-p90 over its instances, as a row of ``kernels.csv``
  (``paratwin bench``), so the same roofline fit applies;
- **collectives**: every instance, from when its last member arrived to when it ended, i.e.
  the shortest member's span (clock-free: each span is one rank's clock); grouped by kind,
  group size and bytes, pooled and per group role (tp, dp, ...), as rows of
  ``collectives.csv``. Two waits the twin's identical ranks do not have are added to the
  fitted latency: the members' arrival spread (max - mean, among the peers of one pipeline
  stage: between stages the spread is structure the twin simulates), and on a host without
  accelerators the hand-off to and from the thread that runs the collective. There a call
  that ran while its node's cores all computed also waited for a core (twin.calibrate.busy):
  that wait is estimated from calls measured both ways, taken off those calls and fitted as
  ``busy_handoff_us``, which the twin adds back where its cores are busy;
- **host gaps**: the time between an op ending and the next op of the same stream
  starting when nothing else held the next one back (all its dependencies on that stream):
  what the rank's host spends between ops (dispatch, the executor's bookkeeping). On a host
  without accelerators (``shared_cpu``) the rank's thread runs the kernels too: the gap is
  part of each op's time and goes into the kind's ``launch_us``; on a GPU the host runs
  ahead of the device and the gap is the kind's issue time, ``host_us``.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from twin import rundir
from twin.calibrate.busy import BUSY_SHARE, busy_handoff, computing, node_compute
from twin.calibrate.fit import robust_cv, weighted_median
from twin.calibrate.gpuhost import HOST_BOUND, gpu_host, host_bound
from twin.calibrate.profile import fit_collectives, fit_kernels, median_or_none
from twin.cost import CostModel, default_cost_model
from twin.kernelshape import timed_flops
from twin.schedule.builder import build_schedule
from twin.schedule.ir import Op
from twin.spec import Job
from twin.spec.io import job_from_dict
from twin.trace import Span, Trace

KERNEL_KINDS = ("gemm", "attention", "elementwise", "optimizer")


class TraceError(ValueError):
    """A directory that is not a usable executor run (named, with the fix)."""


@dataclass
class TracedRun:
    """One executor run directory: its job, its measured spans and step times."""

    path: Path
    job: Job
    spans: list[Span]
    """Spans of the measured steps (warm-up dropped), memory bookkeeping dropped."""
    ops: dict[tuple[int, str], Op]
    """(rank, op name) -> the schedule's op."""
    programs: dict[int, list[Op]]
    step_s: float
    step_p10_s: float
    step_p90_s: float
    meta: dict = dataclasses.field(default_factory=dict)
    """The trace's metadata: backend, host, torch version, ..."""
    host_issue_s: dict = dataclasses.field(default_factory=dict)
    """Per rank (str), the host's median time to issue a step (summary.json; GPU runs)."""
    host_issue_by_kind_s: dict = dataclasses.field(default_factory=dict)
    """Per rank (str), per op kind, the host's time per step issuing ops of that kind."""


def load_run(path: str | Path) -> TracedRun:
    """A run directory of ``paratwin execute``; TraceError naming what is missing."""
    path = Path(path)
    if not path.is_dir():
        raise TraceError(f"traces: {path} is not a directory; give run directories written "
                         "by `paratwin execute`")
    trace_file = rundir.find_trace(path)
    summary = rundir.read_summary(path)
    if trace_file is None or summary is None:
        missing = "spans.json" if trace_file is None else "summary.json"
        raise TraceError(f"traces: {path} has no {missing}; it is not a finished "
                         "`paratwin execute` run (run it again, or leave it out)")
    try:
        trace = Trace.load(trace_file)
    except (OSError, ValueError) as err:
        raise TraceError(f"traces: {trace_file} is not a paratwin trace ({err})") from None
    if trace.meta.get("source") != "executor" or "job" not in trace.meta:
        raise TraceError(f"traces: {trace_file} was not measured by `paratwin execute` "
                         f"(source {trace.meta.get('source')!r}); a twin trace predicts, it "
                         "does not measure")
    job = job_from_dict(trace.meta["job"])
    warmup = int(trace.meta.get("warmup", 0) or 0)
    spans = [s for s in trace.spans if s.step >= warmup and s.stream != "mem"]
    if not spans:
        raise TraceError(f"traces: {path} holds no measured step after its {warmup} warm-up "
                         "steps; execute with more steps")
    schedule = build_schedule(job)
    ranks = sorted({s.rank for s in spans})
    programs = {r: schedule.program(r).ops for r in ranks}
    ops = {(r, op.name): op for r in ranks for op in programs[r]}
    step = float(summary.get("step_time_s") or 0.0)
    if step <= 0:
        raise TraceError(f"traces: {path}/summary.json has no measured step time")
    return TracedRun(path, job, spans, ops, programs, step,
                     float(summary.get("step_time_p10_s") or step),
                     float(summary.get("step_time_p90_s") or step), dict(trace.meta),
                     dict(summary.get("host_issue_s") or {}),
                     dict(summary.get("host_issue_by_kind_s") or {}))


def _comm_busy(spans: Iterable[Span], node_of) -> dict[tuple[int, int], np.ndarray]:
    """(step, node) -> sorted [start, end] intervals of communication there."""
    out: dict[tuple[int, int], list] = defaultdict(list)
    for s in spans:
        if s.stream != "compute":
            out[(s.step, node_of(s.rank))].append((s.start_us, s.end_us))
    return {k: np.array(sorted(v)) for k, v in out.items()}


def _overlaps(intervals: np.ndarray | None, start: float, end: float, tol: float) -> bool:
    """Whether any interval overlaps [start, end] by more than ``tol`` of its length."""
    if intervals is None or not len(intervals):
        return False
    lo = np.maximum(intervals[:, 0], start)
    hi = np.minimum(intervals[:, 1], end)
    return bool(np.sum(np.clip(hi - lo, 0.0, None)) > tol * max(end - start, 1e-9))


QUIET_TOL = 0.05
"""An op is quiet when the other activity on its node overlaps under 5% of it."""


def _stats(samples: list[tuple[tuple, float]]) -> dict:
    """The spread of an op's instances; ``time_s_median`` (the column the fits read) holds
    their mean: a step pays the sum of its ops, and one op's few instances in a step are
    too few for ``per_step``'s median to keep the tail the step's many ops pay."""
    t = np.asarray([v for _, v in samples], float)
    return {"time_s_median": float(t.mean()), "time_s_p10": float(np.percentile(t, 10)),
            "time_s_p90": float(np.percentile(t, 90)), "samples": len(t)}


def measurements(runs: list[TracedRun], kernel_runs: set[int] | None = None
                 ) -> tuple[list[dict], list[dict], dict, dict, dict, dict]:
    """What ``runs`` measured: kernel rows of their quiet compute ops and collective rows of
    every collective (as ``paratwin bench`` writes them; collectives pooled, ``role`` "", and
    per group role), then in microseconds the host gaps (per kind of the op that waited),
    the hand-offs (per collective kind) and the arrival spread (per fit key, pooled and
    ``@role``), each as ((run, step), microseconds) samples (``per_step``), and on shared
    cores what a call waits more beside busy cores (twin.calibrate.busy: ``us``, None when
    no call measured it, and ``sizes``), taken off those calls' times in their rows.
    ``kernel_runs``: the runs (indices) whose compute ops give kernel rows (None: all)."""
    kernels: dict[tuple, list[float]] = defaultdict(list)
    colls: dict[tuple, list] = defaultdict(list)
    gaps: dict[str, list[float]] = defaultdict(list)
    handoff: dict[str, list[float]] = defaultdict(list)
    skew: dict[str, list[float]] = defaultdict(list)
    for i, run in enumerate(runs):
        gpn = run.job.cluster.gpus_per_node
        busy = _comm_busy(run.spans, lambda r, gpn=gpn: r // gpn)
        shared = run.job.cluster.intra.kind == "shared_cpu"
        comp = node_compute(run.spans, lambda r, gpn=gpn: r // gpn) if shared else {}
        cores = BUSY_SHARE * (run.job.cluster.cores_per_node or gpn)
        members: dict[tuple, list[Span]] = defaultdict(list)
        for s in run.spans:
            op = run.ops.get((s.rank, s.op))
            if op is None:
                continue
            if op.is_compute and op.kind in KERNEL_KINDS:
                if kernel_runs is not None and i not in kernel_runs:
                    continue
                if not _overlaps(busy.get((s.step, s.rank // gpn)), s.start_us, s.end_us, QUIET_TOL):
                    kernels[(op.kind, op.dtype, timed_flops(op), op.bytes, op.shape)].append(
                        ((i, s.step), s.dur_us * 1e-6))
            elif op.is_collective:
                members[(s.step, op.group, op.name)].append(s)
        for (step, group, name), got in members.items():
            if len(got) < len(group):
                continue  # a member's span is missing (a partial trace)
            last = min(got, key=lambda s: s.dur_us)  # the last to arrive: the transfer itself
            op = run.ops[(last.rank, name)]
            if len({run.job.grid.coord(r, "pp") for r in group}) == 1:
                # members with one program (dp/tp peers of a stage): their spread is noise;
                # between pipeline stages it is structure, which the twin simulates
                starts = [m.start_us for m in got]
                spread = max(starts) - sum(starts) / len(starts)
                skew[f"{last.kind}/intra/{len(group)}"].append(((i, step), spread))
                skew[f"{last.kind}/intra/{len(group)}@{op.group_name}"].append(((i, step), spread))
            beside = shared and computing(comp.get((step, last.rank // gpn)), last.start_us,
                                          last.end_us) >= cores
            for role in ("", op.group_name):  # every group, and each role's (tp, dp, ...) own
                colls[(op.kind, len(group), op.bytes, role)].append(
                    ((i, step), last.dur_us * 1e-6, beside))
        _gaps(run, i, gaps, handoff)
    wait, sizes = busy_handoff({k: [(t, b) for _, t, b in v] for k, v in colls.items() if not k[3]})
    kernel_rows = [{"kind": k[0], "dtype": k[1], "flops": k[2], "bytes": k[3], **_stats(t)}
                   for k, t in kernels.items()]
    coll_rows = [{"kind": k[0], "group_size": k[1], "bytes": k[2], "role": k[3],
                  **_stats([(tag, t - (wait or 0.0) * b) for tag, t, b in v])}
                 for k, v in colls.items()]
    return kernel_rows, coll_rows, dict(gaps), dict(handoff), dict(skew), \
        {"us": None if wait is None else wait * 1e6, "sizes": sizes}


def _gaps(run: TracedRun, i: int, gaps: dict, handoff: dict) -> None:
    """Per op, the time between what it waited for ending and its start: a compute op held
    back by its own stream only (``gaps``, per kind: the host between ops), a collective
    after the compute it needs and an op woken by a collective (``handoff``, per
    collective kind: handing work to and from the thread that runs it)."""
    for rank, prog in run.programs.items():
        named: dict[int, dict[str, Span]] = defaultdict(dict)
        for s in run.spans:
            if s.rank == rank:
                named[s.step][s.op] = s
        for step, spans in named.items():
            last_end: dict[str, float] = {}
            for op in prog:
                s = spans.get(op.name)
                if s is None:
                    continue
                deps = [prog[d] for d in op.deps if prog[d].name in spans]
                ready = max([spans[d.name].end_us for d in deps] +
                            ([last_end[op.stream]] if op.stream in last_end else []), default=None)
                last_end[op.stream] = s.end_us
                if ready is None:
                    continue
                gap = max(0.0, s.start_us - ready)
                waited = [d for d in deps if d.stream != op.stream]
                if op.is_compute and op.kind in KERNEL_KINDS:
                    if not waited:
                        gaps[op.kind].append(((i, step), gap))
                    elif all(d.is_collective for d in waited):
                        handoff[waited[0].kind].append(((i, step), gap))
                elif op.is_collective and waited and all(d.is_compute for d in waited):
                    handoff[op.kind].append(((i, step), gap))


def per_step(samples: list[tuple[tuple, float]]) -> float:
    """The typical step's mean of ``samples`` ((run, step) tag, value): each measured step's
    mean, then their median. A step pays the sum of its ops' times and waits, heavy tail and
    all (a rank descheduled for a 4 ms tick here and there, every step), so within a step
    the mean; the validation holds the twin against the median step, so a rare stall that
    slows one step is left out with it. (A trimmed mean over all instances, which this
    replaced, cut the tail every step pays: on this machine it left host gaps 2-4x short and
    made every prediction too fast.)"""
    by: dict[tuple, list[float]] = defaultdict(list)
    for tag, v in samples:
        by[tag].append(v)
    return float(np.median([np.mean(v) for v in by.values()]))


def fit_traces(runs: list[TracedRun], name: str, base: CostModel | None = None,
               start_kernels: bool = False) -> tuple[CostModel, dict]:
    """The profile fitted from ``runs`` (one cluster) and a report of every fit.

    ``base``: where the fit starts (the cluster's profile); what the traces do not measure
    (a collective seen at one size only, cores and interference) is kept from it.
    ``start_kernels`` (GPU runs): its kernels are kept, not fitted to the spans, and only the
    host's costs are scaled to the runs (twin/calibrate/gpuhost.py)."""

    if not runs:
        raise TraceError("traces: no run directories given")
    cluster = runs[0].job.cluster
    others = sorted({str(r.path) for r in runs if r.job.cluster.name != cluster.name})
    if others:
        raise TraceError(f"traces: runs of one cluster only; {', '.join(others)} ran on another "
                         f"cluster than {runs[0].path} ({cluster.name})")
    base = base or default_cost_model(cluster)
    cpu = cluster.intra.kind == "shared_cpu"
    # on a GPU, a host-bound run's spans hold the host's launch lag: its kernels are not timed
    bound = set() if cpu else {i for i, r in enumerate(runs) if host_bound(r)}
    if len(bound) == len(runs) and not start_kernels:
        raise TraceError(f"traces: every run was bound by its host (it issued each step in "
                         f"{HOST_BOUND:.0%} of it or more): its spans time the host's launch lag, "
                         "not kernels; add a run the GPU bounds (a larger micro-batch), or keep a "
                         "GPU sweep's kernels (start=<its profile> start_kernels=true)")
    krows, crows, gaps, handoff, skew, beside = measurements(runs, set(range(len(runs))) - bound or None)
    if not krows:
        raise TraceError("traces: no compute op ran alone on its node in these runs; nothing "
                         "to fit (run with fewer ranks than cores, or add runs)")
    dtypes = sorted({r["dtype"] for r in krows})
    dtype = "fp32" if "fp32" in dtypes and cpu else dtypes[0]
    defaults, by_dtype, kfits = fit_kernels(krows, cluster, base, dtype)
    gap_us = {k: per_step(v) for k, v in gaps.items() if v}
    host = {}
    if cpu:  # the host between ops is the rank's own time: the launch term takes it
        defaults = {kind: dataclasses.replace(k, launch_us=k.launch_us + gap_us.get(kind, 0.0))
                    for kind, k in defaults.items()}
        by_dtype = {dt: {kind: dataclasses.replace(k, launch_us=k.launch_us + gap_us.get(kind, 0.0))
                         for kind, k in ks.items()} for dt, ks in by_dtype.items()}
    else:
        defaults, by_dtype, kfits, host = gpu_host([runs[i] for i in sorted(bound)], base, defaults,
                                                   by_dtype, kfits, gap_us, start_kernels)
    every = [r for r in crows if not r["role"]]
    cap = BW_CAP * cluster.intra.bw_GBps
    unidentified: list[str] = []
    cfits = physical(fit_collectives(every)[0], cap, unidentified)
    cfits.update(latency_only(every, cfits, base.collective_fits))
    for role in sorted({r["role"] for r in crows} - {""}):  # kind/intra/n@role: one role's own
        rows = [r for r in crows if r["role"] == role]
        own = physical({f"{k}@{role}": v for k, v in fit_collectives(rows)[0].items()}, cap,
                       unidentified)
        cfits.update(own)
        cfits.update(latency_only(rows, own, {**base.collective_fits, **cfits}, f"@{role}"))
    handoff_us = {k: per_step(v) for k, v in handoff.items() if v}
    skew_us = {k: per_step(v) for k, v in skew.items() if v}
    for key, fit in cfits.items():
        # the last member arrives after the others by their noise, which the twin's
        # identical ranks do not have: on average max(arrival) - mean(arrival) more
        fit["latency_us"] += skew_us.get(key, 0.0)
        if cpu:  # the rank's threads hand a collective over and back
            fit["latency_us"] += handoff_us.get(key.split("/")[0], 0.0)
    changes: dict = {**defaults, "kernels_by_dtype": {
        **base.kernels_by_dtype, **{dt: {**base.kernels_by_dtype.get(dt, {}), **ks}
                                    for dt, ks in by_dtype.items()}},
                     "collective_fits": {**base.collective_fits, **cfits}}
    if beside["us"] is not None:
        changes["busy_handoff_us"] = beside["us"]
    timed = [(r["time_s_median"], r["time_s_p10"], r["time_s_p90"]) for r in krows
             if r["time_s_median"] > 2e-3]
    if timed:
        changes["compute_cv"] = robust_cv(timed)
    comm = [(r["time_s_median"], r["time_s_p10"], r["time_s_p90"]) for r in every]
    if comm:
        changes["comm_cv"] = robust_cv(comm)
    meta = runs[0].meta
    provenance = {"source": "traces", "cluster": cluster.name,
                  **{k: meta[k] for k in ("backend", "host", "torch_version", "device")
                     if k in meta},
                  **({"gpus": []} if meta.get("backend") == "gloo" else {}),
                  "runs": [str(r.path) for r in runs], "base": base.name,
                  "fit_residuals": {
                      "kernels_median": median_or_none([f.median_abs_residual for f in kfits.values()]),
                      "collectives_median": median_or_none([v["residual_median"] for v in cfits.values()])}}
    profile = dataclasses.replace(base, name=name, provenance=provenance, **changes)
    report = {
        "kernels": {k: {"params": f.params, "residual_median": f.median_abs_residual,
                        "residual_max": f.max_abs_residual, "points": len(f.residuals)}
                    for k, f in kfits.items()},
        "collectives": cfits,
        "host_gap_us": {k: {"step_mean": g, "median": float(np.median([v for _, v in gaps[k]])),
                            "samples": len(gaps[k]), "into": "launch_us" if cpu else "host_us"}
                        for k, g in gap_us.items()},
        "handoff_us": {k: {"step_mean": g, "samples": len(handoff[k]),
                           "into": "latency_us" if cpu else "not used"}
                       for k, g in handoff_us.items()},
        "skew_us": {k: {"step_mean": g, "samples": len(skew[k]), "into": "latency_us"}
                    for k, g in skew_us.items()},
        "busy_handoff_us": {**beside, "into": "busy_handoff_us"},
        "collectives_kept": sorted(set(base.collective_fits) - set(cfits)),
        "bandwidth_unidentified": sorted(unidentified),
        "measured": {"kernel_rows": len(krows), "collective_rows": len(crows)},
        "host_bound": {"runs": [str(runs[i].path) for i in sorted(bound)], **host},
    }
    return profile, report


BW_CAP = 10.0
"""A fitted bandwidth above this multiple of the link's nominal one is not a bandwidth: the
sizes a traced run repeats did not separate it from the latency (a larger message that ran no
slower); that kind and size keep the start profile's bandwidth (``latency_only``)."""


def physical(fits: dict, cap_GBps: float, dropped: list[str]) -> dict:
    """``fits`` without those whose bandwidth exceeds ``cap_GBps`` (their keys go to ``dropped``)."""
    out = {}
    for key, fit in fits.items():
        if fit["bw_GBps"] > cap_GBps:
            dropped.append(key)
        else:
            out[key] = fit
    return out


def latency_only(rows: list[dict], fitted: dict, fits: dict, suffix: str = "") -> dict:
    """Collectives measured at one size only: their latency, the bandwidth kept from ``fits``
    (a traced run repeats few sizes; small ones are all latency); keys end in ``suffix``."""
    sizes: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        sizes[f"{r['kind']}/intra/{int(r['group_size'])}"].append(r)
    out = {}
    for plain, got in sizes.items():
        key, old = plain + suffix, fits.get(plain)
        if key in fitted or old is None:
            continue
        bw = float(old["bw_GBps"]) * 1e9
        lat = [max(0.0, r["time_s_median"] - r["bytes"] / bw) for r in got]
        out[key] = {"latency_us": weighted_median(lat, [r["samples"] for r in got]) * 1e6,
                    "bw_GBps": bw / 1e9,
                    "residual_median": 0.0, "residual_max": 0.0, "points": len(got)}
    return out
