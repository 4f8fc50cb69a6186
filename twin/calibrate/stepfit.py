"""Fit the cost model to measured step times of whole runs.

Each run is simulated once with the current parameters and its critical path kept
(``twin.calibrate.critical``); the parameters are then fitted on the paths by
``scipy.optimize.least_squares`` (soft-L1 loss on log(predicted / measured), a weak pull
towards the starting values so that what the data cannot tell apart stays where it was),
and the runs are simulated again with the fitted values, whose paths may differ (a step
that was host-bound may not be any more). Three rounds settle it. The schedule of a run
never changes while its costs are fitted, so it is built once.

What is fitted (``FREE``): per compute kind its efficiency (GEMM, attention), memory
efficiency (attention, elementwise, optimizer), device launch overhead and host issue
time, plus the host time of a collective and the latency of a send/recv. Collectives are
not fitted here: their latency and bandwidth come from nccl-tests or ``paratwin bench``.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import numpy as np
from scipy.optimize import least_squares
from scipy.sparse import csr_matrix

from twin.calibrate.kindtime import KindRetimer
from twin.calibrate.params import (  # noqa: F401 - the fit's parameter space, public here
    CPU_FREE,
    CPU_STEP_FREE,
    FREE,
    HALF_FLOPS,
    HALF_FLOPS_START,
    LAUNCH_MAX_US,
    free_for,
    get,
    restore,
    with_params,
)
from twin.calibrate.shapes import shape_columns, shape_pick, shaped_times
from twin.cost import SHAPE_RANGE, SHAPED_KINDS, CostModel, KernelCost
from twin.kernelshape import shape_key
from twin.schedule.builder import build_schedule
from twin.sim.critical import CriticalPath, critical_path
from twin.sim.critical import host_us as host_us_of
from twin.sim.engine import SimOptions, Simulation, fold_classes
from twin.spec import Job

ROBUST_ROWS = 100
"""From this many runs on, the fit's loss is robust (soft L1 beyond a 5% error: a large
measured set has rows no cost model should chase); fewer are fitted by least squares, each
run a configuration of its own (a robust loss lets a few runs' fit give up a whole paradigm:
on this machine's PyTorch steps it gave DDP up at +73% to fit the others)."""
PRIOR_WEIGHT = 0.05
"""Residual weight pulling each log-parameter towards its start (0.05: a factor e away
costs as much as a 5% error on one run)."""
CENTER_WEIGHT = 10.0
"""Weight of the residual holding the mean log factor of each kind's shapes at 0."""
FD_STEP = 1e-6
"""Step in log-parameter of the forward differences for the model's own fields."""
ROUNDS = 3
FOLD = "all"
"""Runs are simulated folded: copies along dp and tp are exact (tests/sim fold tests)."""


def fit_start(base: CostModel, sm_count: int | None, p2p_host_sync: bool | None = None,
              shared_cpu: bool = False) -> CostModel:
    """Where a fit from runs starts: ``base`` with every mechanism on at a typical size
    (GEMM tiles of 128 on a GPU with known SMs, tens of microseconds of host time per op,
    a send/recv latency), so that the first simulation already shows which runs are
    host-bound; ``p2p_host_sync``: the framework synchronizes after send/recv (Megatron).
    ``shared_cpu``: ranks on CPU cores, whose per-op cost is in launch_us (CPU_FREE): ``base``
    as it is but for the send/recv latency, ``p2p_host_sync`` and a call's and a TP GEMM's
    host time (100 us where it has none)."""
    if shared_cpu:
        return dataclasses.replace(
            base, p2p_latency_us=base.p2p_latency_us or 10.0,
            host_comm_us=base.host_comm_us or 100.0, host_tp_gemm_us=base.host_tp_gemm_us or 100.0,
            p2p_host_sync=base.p2p_host_sync if p2p_host_sync is None else p2p_host_sync)
    def kernel(kind: str, host_us: float, **more) -> KernelCost:
        k = getattr(base, kind)
        return dataclasses.replace(k, host_us=k.host_us or host_us, half_flops=0.0, **more)

    tile = {"tile": 128} if sm_count else {}
    return dataclasses.replace(
        base, gemm=kernel("gemm", 60.0, **tile), attention=kernel("attention", 100.0),
        elementwise=kernel("elementwise", 60.0), optimizer=kernel("optimizer", 100.0),
        host_comm_us=base.host_comm_us or 60.0, p2p_latency_us=base.p2p_latency_us or 10.0,
        host_comm_per_rank_us=base.host_comm_per_rank_us or 5.0,
        p2p_host_sync=base.p2p_host_sync if p2p_host_sync is None else p2p_host_sync)


def p2p_latency_s(cost: CostModel) -> float:
    return (cost.p2p_latency_us or 0.0) * 1e-6


def simulate_path(job: Job, cost: CostModel) -> CriticalPath:
    """One step of ``job`` under ``cost`` (folded) and its critical path."""
    classes = fold_classes(job, FOLD)
    schedule = build_schedule(job)
    programs = {rep: schedule.program(rep) for rep in classes}
    sim = Simulation(job, programs, cost, SimOptions(fold=FOLD), classes)
    sim.run()
    return critical_path(sim, p2p_latency_s(cost))


def _paths(args: tuple[list[Job], CostModel]) -> list[CriticalPath]:
    jobs, cost = args
    return [simulate_path(j, cost) for j in jobs]


def predict(jobs: Sequence[Job], cost: CostModel, workers: int | None = None,
            progress: Callable[[int, int], None] | None = None) -> list[CriticalPath]:
    """The critical path (and step time, ``.step_s``) of each job under ``cost``, simulated
    in ``workers`` processes (default: the machine's cores)."""
    workers = max(1, min(workers or os.cpu_count() or 1, len(jobs)))
    chunk = max(1, math.ceil(len(jobs) / (workers * 8)))
    parts = [list(jobs[i:i + chunk]) for i in range(0, len(jobs), chunk)]
    out: list[CriticalPath] = []
    if workers == 1:
        for k, part in enumerate(parts):
            out += _paths((part, cost))
            if progress:
                progress(min((k + 1) * chunk, len(jobs)), len(jobs))
        return out
    with ProcessPoolExecutor(workers) as pool:
        for k, res in enumerate(pool.map(_paths, [(p, cost) for p in parts])):
            out += res
            if progress:
                progress(min((k + 1) * chunk, len(jobs)), len(jobs))
    return out


@dataclass
class StepFit:
    """The fitted profile and how the fit went."""

    cost: CostModel
    params: dict[str, float]
    residuals: list[float]
    """log(predicted / measured) of the training runs, on their last paths."""
    rounds: list[dict]
    """Per round: its median and largest absolute error and seconds taken."""
    seconds: float
    unexercised: list[str] = dataclasses.field(default_factory=list)
    """Free fields no run's critical path depended on in any round: not measured, so they
    keep the values of the fit's ``keep`` profile."""


class _Retimer:
    """Step times of fixed critical paths under parameter vectors, fast: the unique compute
    ops of all paths are timed once per evaluation and summed through a sparse matrix. With
    ``shapes`` (shape keys), each GEMM / attention op of a listed shape has its roofline time
    scaled by that shape's factor (``CostModel.shape_factors``), whose derivatives are exact
    (``jacobian``)."""

    def __init__(self, paths: list[CriticalPath], gpu, base: CostModel, free=FREE,
                 dtypes: Sequence[str] = (), shapes: Sequence[str] = ()):
        self.gpu, self.free, self.dtypes = gpu, free, tuple(dtypes)
        self.base = dataclasses.replace(base, shape_factors={}) if shapes else base
        index: dict = {}
        rows, cols, vals = [], [], []
        for r, p in enumerate(paths):
            for op, n in p.compute.items():
                rows.append(r)
                cols.append(index.setdefault(op, len(index)))
                vals.append(n)
        self.ops = list(index)
        self.counts = csr_matrix((vals, (rows, cols)), shape=(len(paths), len(self.ops)))
        self.shape_of = shape_columns(self.ops, shapes)
        self.n_shapes = len(shapes)
        kinds = sorted({k for p in paths for k in p.host})
        self.host_kinds = kinds
        self.host = np.array([[p.host.get(k, 0) for k in kinds] for p in paths], float)
        self.fixed = np.array([p.comm_s + p.p2p_s + p.other_s - p.p2p_n * p.p2p_latency_s
                               for p in paths])
        self.p2p_n = np.array([p.p2p_n for p in paths], float)

    def parts(self, values, shape_logs=()) -> tuple[np.ndarray, np.ndarray]:
        """(step time of each path, the shaped roofline seconds of each op)."""
        cost = with_params(self.base, values, self.free, self.dtypes)
        times, shaped = shaped_times(cost, self.ops, self.gpu, self.shape_of, shape_logs)
        dtype = self.dtypes[0] if len(self.dtypes) == 1 else ""
        host_us = np.array([host_us_of(cost, k, dtype) for k in self.host_kinds])
        host = self.host @ host_us * 1e-6 if self.host_kinds else 0.0
        step = self.counts @ times + host + self.fixed + self.p2p_n * p2p_latency_s(cost)
        return step, shaped

    def __call__(self, values, shape_logs=()) -> np.ndarray:
        return self.parts(values, shape_logs)[0]

    def shape_jacobian(self, shaped: np.ndarray) -> csr_matrix:
        """d step / d log(shape factor): per path, the shaped seconds it spends in each shape."""
        return (self.counts @ shape_pick(shaped, self.shape_of, self.n_shapes)).tocsr()


def path_shapes(paths: Sequence[CriticalPath]) -> list[str]:
    """The GEMM and attention shape keys on ``paths`` (sorted)."""
    return sorted({shape_key(op) for p in paths for op in p.compute if op.kind in SHAPED_KINDS})


def fit_steps(jobs: Sequence[Job], measured_s: Sequence[float], base: CostModel,
              rounds: int = ROUNDS, workers: int | None = None, free=None,
              log: Callable[[str], None] | None = None, shapes: bool | None = None,
              gemm_ceiling: float | None = None,
              kinds: Sequence[Mapping[str, float]] | None = None,
              keep: CostModel | None = None) -> StepFit:
    """Fit ``free`` fields of ``base`` (default: ``free_for`` the jobs' cluster) to the
    measured step times of ``jobs``; with ``shapes`` (default: on GPUs) also one factor per
    GEMM and attention shape on the runs' critical paths (``CostModel.shape_factors``), pulled
    towards the model (factor 1) as the other fields are towards their start.

    ``gemm_ceiling``: the efficiency the largest GEMMs reach on this GPU (its maximum achievable
    matmul FLOP/s over peak, measured or published), held fixed while the fit frees how
    efficiency rises with a GEMM's size (``gemm.half_flops``). Runs of small models cannot tell
    how large GEMMs run; without a ceiling the fitted level is the small GEMMs' and a larger
    model is predicted too slow (benchmarks/accuracy_a100.py: fit on hidden 1024, predict 2048).

    ``kinds``: per job, the seconds per step a rank spends in each kind's ops where measured
    (a profiler's), fitted beside the step times (twin.calibrate.kindtime).

    ``keep``: the profile whose values the free fields no run exercises keep (default
    ``base``): a field on no run's critical path in any round (a TP cost fitted on runs
    without TP, a send/recv latency without a pipeline) was not measured, and the fit's
    start for it (``fit_start``'s typical size) is a guess (``StepFit.unexercised``)."""
    if len(jobs) != len(measured_s) or not jobs:
        raise ValueError("fit_steps needs one measured step time per job, and some jobs")
    t0 = time.perf_counter()
    if gemm_ceiling is not None:
        if not 0 < gemm_ceiling <= 1:
            raise ValueError(f"gemm_ceiling={gemm_ceiling} must be a fraction of peak in (0, 1]")
        base = with_params(base, [float(gemm_ceiling), base.gemm.half_flops or HALF_FLOPS_START],
                           (("gemm", "efficiency", 0, 1), HALF_FLOPS), list(base.kernels_by_dtype))
    free = free_for(jobs[0].cluster, gemm_ceiling is not None, base) if free is None else free
    if shapes is None:
        shapes = jobs[0].cluster.intra.kind != "shared_cpu"
    dtypes = sorted({j.model.dtype for j in jobs})
    dtype = dtypes[0] if len(dtypes) == 1 else ""
    meas = np.asarray(measured_s, float)
    if base.p2p_latency_us is None:
        base = dataclasses.replace(base, p2p_latency_us=5.0)
    lo = np.log([f[2] for f in free])
    hi = np.log([f[3] for f in free])
    # a field at 0 (a mechanism the base leaves off) starts at its lower bound
    x0 = np.clip(np.log([max(get(base, k, n, dtype), f_lo) for k, n, f_lo, _ in free]), lo + 1e-9,
                 hi - 1e-9)
    start = x0.copy()
    factors = {k: math.log(v) for k, v in base.shape_factors.items()} if shapes else {}
    cost, history, resid = base, [], np.zeros(len(jobs))
    gpu = jobs[0].cluster.gpu
    g = len(free)
    exercised = np.zeros(g, bool)  # some run's path depends on the field (a non-zero column)
    by_kind = KindRetimer(jobs, kinds, gpu, lambda v: with_params(base, v, free, dtypes)) \
        if kinds and any(kinds) else None
    for k in range(rounds):
        tr = time.perf_counter()
        paths = predict(jobs, cost, workers)
        sim_err = np.array([p.step_s for p in paths]) / meas - 1
        keys = path_shapes(paths) if shapes else []
        if by_kind:
            by_kind.shapes(keys)
        retime = _Retimer(paths, gpu, base, free, dtypes, keys)
        s0 = np.array([factors.get(key, 0.0) for key in keys])
        s_start = np.array([math.log(base.shape_factors.get(key, 1.0)) for key in keys])
        prior = np.concatenate([start, s_start])
        lo_all = np.concatenate([lo, np.full(len(keys), math.log(SHAPE_RANGE[0]))])
        hi_all = np.concatenate([hi, np.full(len(keys), math.log(SHAPE_RANGE[1]))])

        # the factors of one kind average to 1 (in log): the kind's efficiency keeps the level,
        # the factors only the jagged part the smooth model misses
        center = np.zeros((len({key.partition(":")[0] for key in keys}), g + len(keys)))
        for row, kind in enumerate(sorted({key.partition(":")[0] for key in keys})):
            cols = [g + i for i, key in enumerate(keys) if key.partition(":")[0] == kind]
            center[row, cols] = CENTER_WEIGHT / len(cols)

        def residuals(x, retime=retime, prior=prior, center=center):
            pred = retime(np.exp(x[:g]), x[g:])
            held = by_kind.residuals(np.exp(x[:g]), x[g:]) if by_kind else []
            return np.concatenate([np.log(pred / meas), held, PRIOR_WEIGHT * (x - prior), center @ x])

        def jacobian(x, retime=retime, center=center):
            pred, shaped = retime.parts(np.exp(x[:g]), x[g:])
            cols = []
            for j in range(g):  # the model's fields: forward differences
                xj = x[:g].copy()
                xj[j] += FD_STEP
                cols.append((np.log(retime(np.exp(xj), x[g:])) - np.log(pred)) / FD_STEP)
            top = np.column_stack(cols)
            if retime.n_shapes:
                top = np.hstack([top, (retime.shape_jacobian(shaped).multiply(1 / pred[:, None]))
                                 .toarray()])
            held = [by_kind.jacobian(x[:g], FD_STEP, x[g:])] if by_kind else []
            for rows in (top, *held):
                np.logical_or(exercised, np.any(rows[:, :g] != 0, axis=0), out=exercised)
            return np.vstack([top, *held, PRIOR_WEIGHT * np.eye(len(x)), center])

        x_init = np.clip(np.concatenate([x0, s0]), lo_all + 1e-9, hi_all - 1e-9)
        sol = least_squares(residuals, x_init, jac=jacobian, bounds=(lo_all, hi_all),
                            loss="soft_l1" if len(jobs) >= ROBUST_ROWS else "linear",
                            f_scale=0.05, x_scale=1.0, max_nfev=200)
        x0 = sol.x[:g]
        factors.update(zip(keys, sol.x[g:].tolist()))
        cost = with_params(base, np.exp(x0), free, dtypes)
        if shapes:
            cost = dataclasses.replace(cost, shape_factors={
                key: round(math.exp(v), 6) for key, v in sorted(factors.items())})
        resid = sol.fun[: len(jobs)]
        history.append({"round": k + 1, "simulated_median_abs_error": float(np.median(np.abs(sim_err))),
                        "simulated_max_abs_error": float(np.max(np.abs(sim_err))),
                        "fitted_median_abs_error": float(np.median(np.abs(np.expm1(resid)))),
                        "fitted_max_abs_error": float(np.max(np.abs(np.expm1(resid)))),
                        "shapes": len(keys), "seconds": time.perf_counter() - tr})
        if log:
            h = history[-1]
            log(f"round {k + 1}/{rounds}: simulated median |error| "
                f"{h['simulated_median_abs_error']:.1%} -> fitted on the paths "
                f"{h['fitted_median_abs_error']:.1%} (largest {h['fitted_max_abs_error']:.1%})"
                + (f", {len(keys)} kernel shapes" if keys else "") + f", {h['seconds']:.0f} s")
    unmeasured = [f for f, on in zip(free, exercised) if not on]
    cost = restore(cost, base if keep is None else keep, unmeasured, dtypes)
    params = {f"{k}.{n}" if k else n: get(cost, k, n, dtype) for k, n, _, _ in free}
    return StepFit(cost, params, [float(r) for r in resid], history, time.perf_counter() - t0,
                   sorted(f"{k}.{n}" if k else n for k, n, _, _ in unmeasured))
