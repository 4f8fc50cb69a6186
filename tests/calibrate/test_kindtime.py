"""Measured time per op kind as fit targets: the prediction's closed form, and a fit that
places each kind's cost where the measured kinds say when step times alone cannot."""

from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np
import pytest

from tests.calibrate.test_stepfit import CPU_TRUE_KERNELS, _cpu_jobs
from twin.calibrate.kindtime import FIT_KINDS, KindRetimer, kind_counts, kind_seconds
from twin.calibrate.stepfit import CPU_FREE, fit_steps, predict, with_params
from twin.cost import CostModel
from twin.kernelshape import shape_key
from twin.schedule.builder import build_schedule
from twin.sim.critical import signature

TRUTH = CostModel(name="cpu-truth", core_share=True, base_latency_us=60.0,
                  kernels_by_dtype={"fp32": CPU_TRUE_KERNELS})


def _pipeline_job():
    return next(j for j in _cpu_jobs() if j.parallel.pp == 2)


def test_kind_counts_are_the_mean_of_the_ranks_programs():
    job = _pipeline_job()
    sched = build_schedule(job)
    per_rank = [Counter(signature(op) for op in sched.program(r).ops if op.kind == "gemm")
                for r in range(job.grid.world_size)]
    assert per_rank[0] != per_rank[1]  # two stages: the head's GEMMs are the last stage's
    want = {op: (per_rank[0][op] + per_rank[1][op]) / 2 for op in per_rank[0] | per_rank[1]}
    got = kind_counts(job)["gemm"]
    assert set(got) == set(want) and all(got[op] == pytest.approx(n) for op, n in want.items())
    assert set(kind_counts(job)) <= set(FIT_KINDS)


def test_a_kind_is_predicted_as_its_ops_cost_model_times():
    job = _pipeline_job()
    sched = build_schedule(job)
    gpu = job.cluster.gpu
    want = {k: np.mean([sum(TRUTH.compute_time(op, gpu) for op in sched.program(r).ops
                            if op.kind == k) for r in range(job.grid.world_size)])
            for k in ("gemm", "optimizer")}
    rt = KindRetimer([job], [{"gemm": 1.0, "optimizer": 2.0}], gpu, lambda _v: TRUTH)
    assert rt.predict(None) == pytest.approx([want["gemm"], want["optimizer"]], rel=1e-9)
    assert rt.residuals(None) == pytest.approx(0.5 * np.log([want["gemm"] / 1.0,
                                                             want["optimizer"] / 2.0]))
    with pytest.raises(ValueError, match="whose programs have no adam op"):
        KindRetimer([job], [{"adam": 1.0}], gpu, lambda _v: TRUTH)
    # validate's predicted kinds are the same (kind_seconds)
    seconds = kind_seconds(job, TRUTH)
    assert seconds["gemm"] == pytest.approx(want["gemm"], rel=1e-9)
    assert seconds["optimizer"] == pytest.approx(want["optimizer"], rel=1e-9)


def _kind_errors(cost, jobs, measured):
    out = []
    for job, kinds in zip(jobs, measured):
        rt = KindRetimer([job], [kinds], job.cluster.gpu, lambda _v: cost)
        out += list(rt.predict(None) / rt.measured - 1)
    return np.abs(out)


def test_measured_kinds_place_the_costs_step_times_leave_traded():
    """A start that has the GEMMs' cost per op 4x too high and the elementwise ops' 4x too low:
    fitted on step times alone the two trade against each other; with each run's measured
    kind times (2% noise) both land near the truth and every kind's time matches."""
    jobs = _cpu_jobs()
    rng = np.random.default_rng(11)
    noise = lambda: float(np.exp(rng.normal(0, 0.02)))  # noqa: E731
    steps = [p.step_s * noise() for p in predict(jobs, TRUTH, 1)]
    kinds = []
    for job in jobs:
        rt = KindRetimer([job], [dict.fromkeys(FIT_KINDS, 1.0)], job.cluster.gpu, lambda _v: TRUTH)
        kinds.append({k: t * noise() for k, t in zip(sorted(FIT_KINDS), rt.predict(None))})
    start = dataclasses.replace(TRUTH, kernels_by_dtype={"fp32": {
        **CPU_TRUE_KERNELS,
        "gemm": dataclasses.replace(CPU_TRUE_KERNELS["gemm"], launch_us=1600.0),
        "elementwise": dataclasses.replace(CPU_TRUE_KERNELS["elementwise"], launch_us=37.5)}})
    free = tuple(f for f in CPU_FREE if f[1] == "launch_us")
    plain = fit_steps(jobs, steps, start, workers=1, free=free, rounds=2)
    held = fit_steps(jobs, steps, start, workers=1, free=free, rounds=2, kinds=kinds)
    launch = lambda fit, k: fit.cost.kernel(k, "fp32").launch_us  # noqa: E731
    assert launch(held, "gemm") == pytest.approx(400.0, rel=0.15)
    assert launch(held, "elementwise") == pytest.approx(150.0, rel=0.15)
    assert np.median(_kind_errors(held.cost, jobs, kinds)) < 0.03
    assert np.median(_kind_errors(plain.cost, jobs, kinds)) > 2 * np.median(
        _kind_errors(held.cost, jobs, kinds))
    pred = np.array([p.step_s for p in predict(jobs, held.cost, 1)]) / np.array(steps) - 1
    assert np.median(np.abs(pred)) < 0.03
    assert with_params(start, [400.0, 300.0, 150.0, 2000.0], free, ["fp32"]).kernel(
        "gemm", "fp32").launch_us == 400.0  # the free fields are the four kinds' launch_us


def test_shape_factors_scale_a_kinds_roofline_and_their_derivative_is_exact():
    """Where the fit frees kernel shape factors (on GPUs by default), a kind's predicted time
    carries them: a factor f on a GEMM shape scales that shape's roofline time (not its
    launch), and the analytic derivative matches forward differences."""
    job = _pipeline_job()
    gpu = job.cluster.gpu
    rt = KindRetimer([job], [{"gemm": 0.05, "attention": 0.01}], gpu, lambda _v: TRUTH)
    keys = sorted({shape_key(op) for op in rt.ops if op.kind == "gemm"})
    rt.shapes(keys)
    plain = rt.predict(None, np.zeros(len(keys)))
    assert plain == pytest.approx(KindRetimer([job], [{"gemm": 0.05, "attention": 0.01}], gpu,
                                              lambda _v: TRUTH).predict(None))
    launch = sum(n * TRUTH.kernel("gemm", "fp32").launch_us * 1e-6
                 for n in kind_counts(job)["gemm"].values())
    doubled = rt.predict(None, np.full(len(keys), np.log(2.0)))
    # rows in kind order: attention, then gemm
    assert doubled[1] - launch == pytest.approx(2 * (plain[1] - launch))
    assert doubled[0] == pytest.approx(plain[0])  # attention has no GEMM shape
    logs = np.linspace(-0.2, 0.3, len(keys))
    jac = rt.jacobian(np.zeros(0), 1e-6, logs)
    for j in range(len(keys)):
        bumped = logs.copy()
        bumped[j] += 1e-6
        fd = (rt.residuals(None, bumped) - rt.residuals(None, logs)) / 1e-6
        assert jac[:, j] == pytest.approx(fd, rel=1e-4, abs=1e-9)
