"""Measured time per op kind as fit targets, beside the step times.

A step time alone cannot tell the kinds apart: on this machine's PyTorch steps a fit from
step times made the optimizer 50 ms a step plus a tenth of its bandwidth (what FSDP2's and
DTensor's framework costs needed somewhere) and then over-predicted DDP, whose unsharded
optimizer paid it twice. A profiler attributes a step's time to kinds (torch.profiler's CPU
time per op, grouped as ``executor.conformance`` does); a run that comes with it fits each
kind's parameters against that kind's own time.

A run's kind target is the seconds per step one rank spends in the kind's ops, the mean
over the ranks (the runs file's ``gemm_s``, ``attention_s``, ``elementwise_s``,
``optimizer_s``). Its prediction is the same mean over the job's programs: each compute op
of the kind at the cost model's time, uncontended (a profiler's CPU time of an op is its own,
not its wait for a shared core), with the fit's kernel shape factors where it frees them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

import numpy as np
from scipy.sparse import csr_matrix

from twin.calibrate.shapes import shape_columns, shape_pick, shaped_times
from twin.schedule.builder import build_schedule
from twin.sim.critical import signature
from twin.sim.engine import fold_classes
from twin.spec import ConfigError, Job

KIND_WEIGHT = 0.5
"""Weight of a kind's log error beside a step's (a kind's 10% counts as a step's 5%): the
kinds place the parameters, the step times stay what is predicted."""
FIT_KINDS = ("gemm", "attention", "elementwise", "optimizer")
"""The kinds a runs file can give (column ``KIND_s``) and the fit holds."""


def kind_counts(job: Job) -> dict[str, Counter]:
    """Kind -> compute signature -> how many times one rank runs it per step, the mean over
    the world's ranks (folded copies run their representative's program)."""
    classes = fold_classes(job, "all")
    schedule = build_schedule(job)
    world = job.grid.world_size
    out: dict[str, Counter] = {}
    for rep, members in classes.items():
        w = len(members) / world
        for op in schedule.program(rep).ops:
            if op.is_compute and op.kind in FIT_KINDS:
                out.setdefault(op.kind, Counter())[signature(op)] += w
    return out


def kind_seconds(job: Job, cost) -> dict[str, float]:
    """Kind -> the seconds one rank spends in its ops per step, the mean over the ranks, at
    the cost model's time: what a fit predicts for a run's kind target (``KindRetimer``)."""
    gpu = job.cluster.gpu
    return {kind: sum(n * cost.compute_time(op, gpu) for op, n in counts.items())
            for kind, counts in kind_counts(job).items()}


class KindRetimer:
    """Predicted kind times of the runs that measured them, under parameter vectors: every
    distinct compute signature timed once, summed per (run, kind) through a sparse matrix."""

    def __init__(self, jobs: Sequence[Job], measured: Sequence[Mapping[str, float]], gpu,
                 cost_of):
        """``measured``: per job, kind -> seconds (empty where the run has none);
        ``cost_of(values)``: the CostModel a parameter vector stands for."""
        self.gpu, self.cost_of = gpu, cost_of
        index: dict = {}
        rows, cols, vals, meas = [], [], [], []
        for job, kinds in zip(jobs, measured):
            if not kinds:
                continue
            counts = kind_counts(job)
            for kind, seconds in sorted(kinds.items()):
                if kind not in counts:
                    raise ConfigError(f"a measured {kind} time for a run of {job.model.name} "
                                      f"whose programs have no {kind} op; leave its {kind}_s "
                                      "cell empty")
                for op, n in counts[kind].items():
                    rows.append(len(meas))
                    cols.append(index.setdefault(op, len(index)))
                    vals.append(n)
                meas.append(seconds)
        self.ops = list(index)
        self.measured = np.asarray(meas, float)
        self.counts = csr_matrix((vals, (rows, cols)), shape=(len(meas), len(self.ops)))
        self.shape_of = np.full(len(self.ops), -1)

    def __len__(self) -> int:
        return len(self.measured)

    def shapes(self, keys: Sequence[str]) -> None:
        """The shape keys whose factors the fit frees (their log factors follow the model's
        fields in a parameter vector, as in ``twin.calibrate.stepfit``)."""
        self.shape_of = shape_columns(self.ops, keys)

    def parts(self, values, shape_logs=()) -> tuple[np.ndarray, np.ndarray]:
        """(predicted seconds per (run, kind), the shaped roofline seconds of each op)."""
        times, shaped = shaped_times(self.cost_of(values), self.ops, self.gpu, self.shape_of,
                                     shape_logs)
        return self.counts @ times, shaped

    def predict(self, values, shape_logs=()) -> np.ndarray:
        return self.parts(values, shape_logs)[0]

    def residuals(self, values, shape_logs=()) -> np.ndarray:
        """KIND_WEIGHT * log(predicted / measured) per (run, kind)."""
        return KIND_WEIGHT * np.log(self.predict(values, shape_logs) / self.measured)

    def jacobian(self, x: np.ndarray, step: float, shape_logs=()) -> np.ndarray:
        """d residuals / d (x, shape_logs): the model's log-fields by forward differences of
        ``step``, the shape factors exactly."""
        pred, shaped = self.parts(np.exp(x), shape_logs)
        base = KIND_WEIGHT * np.log(pred / self.measured)
        n = len(shape_logs)
        out = np.zeros((len(self), len(x) + n))
        for j in range(len(x)):
            xj = x.copy()
            xj[j] += step
            out[:, j] = (self.residuals(np.exp(xj), shape_logs) - base) / step
        if n:
            pick = shape_pick(shaped, self.shape_of, n)
            out[:, len(x):] = KIND_WEIGHT * (self.counts @ pick).toarray() / pred[:, None]
        return out


def kind_errors(jobs: Sequence[Job], measured: Sequence[Mapping[str, float]], cost) -> dict:
    """Per kind measured in some run: how many runs measured it and the median and largest
    |predicted / measured - 1| under ``cost`` (empty when no run measured a kind)."""
    out: dict[str, dict] = {}
    for job, kinds in zip(jobs, measured):
        if not kinds:
            continue
        rt = KindRetimer([job], [kinds], job.cluster.gpu, lambda _v: cost)
        for kind, err in zip(sorted(kinds), rt.predict(None) / rt.measured - 1):
            out.setdefault(kind, []).append(abs(float(err)))
    return {k: {"rows": len(e), "median_abs_error": float(np.median(e)),
                "max_abs_error": max(e)} for k, e in sorted(out.items())}
