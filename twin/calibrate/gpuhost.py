"""The host's cost per op of a GPU replay, from the time its host took to issue a step.

On a GPU the replay's host issues ops ahead of the device; a step whose host took about as
long as the step itself (``host_issue_s``, recorded by the executor) was bound by the host,
and an op's span then holds the host's launch lag as well as its kernel. Such a run tells the
host's cost per op (its issue time over its ops) but not its kernels' times; a run the
device bound tells the kernels (a run in between tells neither: its host is held back by the
device's full launch queue). ``fit_traces`` takes the kernels from the device-bound runs, or
from the start profile (``start_kernels``: a GPU kernel sweep's, each kernel timed alone),
and scales the start profile's host costs to the host-bound runs' issue time (``host_scale``).
"""

from __future__ import annotations

import dataclasses
import statistics

HOST_BOUND = 0.9
"""A run whose host took at least this share of its step to issue it was bound by the host."""


def host_bound(run) -> bool:
    """Whether the host took HOST_BOUND of ``run``'s measured step to issue it (any rank)."""
    return any(t >= HOST_BOUND * run.step_s for t in run.host_issue_s.values())


def host_scale(runs, cost) -> tuple[float | None, int]:
    """(s, runs used): the factor that makes ``cost``'s host time per step (``host_time``
    summed over a rank's program) equal the measured issue time of each host-bound run, their
    median; None when no run was host-bound (or ``cost`` gives its ops no host time)."""
    ratios = []
    for run in runs:
        if not host_bound(run):
            continue
        for rank, issued in run.host_issue_s.items():
            modelled = sum(cost.host_time(op) for op in run.programs.get(int(rank), []))
            if modelled > 0:
                ratios.append(issued / modelled)
    return (statistics.median(ratios), len(ratios)) if ratios else (None, 0)


def gpu_host(bound_runs, base, defaults: dict, by_dtype: dict, kfits: dict, gap_us: dict,
             start_kernels: bool) -> tuple[dict, dict, dict, dict]:
    """The kernel costs of a GPU traces fit with their host costs: ``base``'s kernels instead
    of the fitted ones under ``start_kernels`` (no fits then); each kind's ``host_us`` the
    runs measured (``host_per_op_us``), else the start profile's (a GPU sweep's), else the gap
    the host left between ops (``gap_us``), scaled to ``bound_runs``' issue times when there
    are any (so that the time the host spent on memory bookkeeping, which the twin gives no
    host time, is shared out over the ops). Returns
    (defaults, by_dtype, kernel fits, a report of the scale)."""
    if start_kernels:
        defaults, kfits = {kind: base.kernel(kind) for kind in defaults}, {}
        by_dtype = {dt: {kind: base.kernel(kind, dt) for kind in ks} for dt, ks in by_dtype.items()}

    measured = host_per_op_us(bound_runs)

    def hosted(kind: str, k, scale: float = 1.0):
        us = measured.get(kind) or base.kernel(kind).host_us or gap_us.get(kind, 0.0)
        return dataclasses.replace(k, host_us=us * scale)

    trial = dataclasses.replace(base, **{kind: hosted(kind, k) for kind, k in defaults.items()},
                                kernels_by_dtype={})
    scale, ranks = host_scale(bound_runs, trial)
    defaults = {kind: hosted(kind, k, scale or 1.0) for kind, k in defaults.items()}
    by_dtype = {dt: {kind: hosted(kind, k, scale or 1.0) for kind, k in ks.items()}
                for dt, ks in by_dtype.items()}
    return defaults, by_dtype, kfits, {"host_scale": scale, "ranks": ranks, "host_us_measured": measured,
                                       "kernels": "start profile" if start_kernels else "fitted"}


def host_per_op_us(runs) -> dict[str, float]:
    """Per compute kind, the host's microseconds to issue one op, where ``runs`` recorded it
    (``host_issue_by_kind_s``: per step and kind, over the kind's ops in the rank's program),
    the median over runs and ranks; empty where none did."""
    samples: dict[str, list[float]] = {}
    for run in runs:
        for rank, kinds in run.host_issue_by_kind_s.items():
            ops = run.programs.get(int(rank), [])
            for kind, seconds in kinds.items():
                count = sum(1 for op in ops if op.kind == kind and op.is_compute)
                if count:
                    samples.setdefault(kind, []).append(seconds / count * 1e6)
    return {kind: statistics.median(v) for kind, v in samples.items()}
