"""The fits recover known parameters from synthetic measurements with noise."""

from __future__ import annotations

import numpy as np
import pytest

from twin.calibrate.fit import KernelPoint, cv_from_spread, fit_kernel, fit_latency_bandwidth, kernel_time
from twin.cost import CostModel, KernelCost

PEAK, BW = 1e11, 3e10


def _noisy(t, rng, cv=0.05):
    return t * rng.lognormal(0.0, cv, size=len(t))


def test_kernel_fit_recovers_the_curve():
    rng = np.random.default_rng(0)
    true = {"efficiency": 0.6, "half_flops": 0.0, "mem_efficiency": 0.7, "launch_us": 20.0}
    n = np.array([16, 32, 64, 128, 256, 512, 768, 1024, 1536, 2048], float)
    flops, nbytes = 2 * n ** 3, 4 * 3 * n ** 2
    t = _noisy(kernel_time(true, flops, nbytes, PEAK, BW), rng)
    fit = fit_kernel([KernelPoint(f, b, x) for f, b, x in zip(flops, nbytes, t)], PEAK, BW)
    assert fit.params["efficiency"] == pytest.approx(0.6, rel=0.1)
    assert fit.params["launch_us"] == pytest.approx(20.0, rel=0.35)
    assert fit.median_abs_residual < 0.06


def test_memory_bound_kernel_fit_recovers_bandwidth_efficiency():
    rng = np.random.default_rng(1)
    true = {"efficiency": 0.5, "half_flops": 0.0, "mem_efficiency": 0.45, "launch_us": 8.0}
    elems = np.logspace(3, 8, 10)
    flops, nbytes = elems, 12 * elems
    t = _noisy(kernel_time(true, flops, nbytes, PEAK, BW), rng)
    fit = fit_kernel([KernelPoint(f, b, x) for f, b, x in zip(flops, nbytes, t)], PEAK, BW,
                     KernelCost(half_flops=0.0, efficiency=0.5), memory_bound=True)
    assert fit.params["mem_efficiency"] == pytest.approx(0.45, rel=0.1)
    assert fit.params["launch_us"] == pytest.approx(8.0, rel=0.35)


def test_latency_bandwidth_fit_is_robust_to_outliers():
    rng = np.random.default_rng(2)
    sizes = 4096 * 4.0 ** np.arange(9)  # 4 KB .. 256 MB
    t = _noisy(50e-6 + sizes / 1.5e9, rng)
    t[2] *= 3.0  # two scheduler hiccups
    t[5] *= 2.5
    fit = fit_latency_bandwidth(list(sizes), list(t))
    assert fit.params["alpha_s"] == pytest.approx(50e-6, rel=0.2)
    assert 1 / fit.params["beta_s_per_byte"] == pytest.approx(1.5e9, rel=0.1)
    assert fit.max_abs_residual > 0.5  # the outliers are reported, not fitted


def test_cv_from_spread_of_a_normal_sample():
    rng = np.random.default_rng(3)
    x = rng.normal(1.0, 0.1, 20000)
    p10, p50, p90 = np.quantile(x, [0.1, 0.5, 0.9])
    assert cv_from_spread(p50, p10, p90) == pytest.approx(0.1, rel=0.05)


def test_profile_round_trips_and_foreign_files_are_refused(tmp_path):
    prof = CostModel(name="fitted", compute_cv=0.03, collective_fits={
        "all_reduce/intra/2": {"latency_us": 80.0, "bw_GBps": 1.4, "residual_median": 0.02}},
        kernels_by_dtype={"bf16": {"gemm": KernelCost(efficiency=0.8)}},
        provenance={"host": "vm", "torch": "2.13.0"})
    path = prof.save(tmp_path / "p.yaml")
    assert CostModel.load(path) == prof
    bad = tmp_path / "bad.yaml"
    bad.write_text("[1, 2")
    with pytest.raises(ValueError, match="not a paratwin calibration profile"):
        CostModel.load(bad)
    assert bad.read_text() == "[1, 2"
    foreign = tmp_path / "foreign.yaml"
    foreign.write_text("format: paratwin-profile\nversion: 1\nmystery: 3\n")
    with pytest.raises(ValueError, match="unknown profile fields"):
        CostModel.load(foreign)


def test_a_swept_gemm_shape_is_timed_as_measured():
    """sweep_shape_factors: measured over modelled time of each swept GEMM shape (launch
    excluded, clamped to the fit's bounds), so compute_time reproduces the sweep there."""
    from twin.calibrate.profile import sweep_shape_factors
    from twin.schedule.ir import Op
    from twin.spec import ClusterSpec, GPUSpec

    cl = ClusterSpec(name="c", num_nodes=1, gpus_per_node=1,
                     gpu=GPUSpec(name="g", peak_tflops={"bf16": 100.0}, hbm_GB=80, hbm_bw_GBps=2000))
    cost = CostModel(gemm=KernelCost(efficiency=0.5, launch_us=10.0))
    m, n, k = 4096, 1024, 2048
    flops = 2.0 * m * n * k
    model = flops / (100e12 * 0.5)
    rows = [{"kind": "gemm", "dtype": "bf16", "shape": f"[{m}, {n}, {k}]", "flops": flops,
             "bytes": 0.0, "time_s_median": 1.5 * model + 10e-6},
            {"kind": "gemm", "dtype": "bf16", "shape": "[64, 64, 64]", "flops": 2.0 * 64 ** 3,
             "bytes": 0.0, "time_s_median": 1.0},  # far off: clamped to the bound
            {"kind": "gemm", "dtype": "fp8", "shape": "[64, 64, 64]", "flops": 1.0,
             "bytes": 0.0, "time_s_median": 1.0},  # a dtype the GPU has no peak for
            {"kind": "elementwise", "dtype": "bf16", "shape": "[4096]", "flops": 0.0,
             "bytes": 1e6, "time_s_median": 1e-3}]
    factors = sweep_shape_factors(rows, cl, cost)
    assert factors == {"gemm:bf16:4096x1024x2048": pytest.approx(1.5), "gemm:bf16:64x64x64": 4.0}
    shaped = CostModel(gemm=cost.gemm, shape_factors=factors)
    op = Op(name="g", kind="gemm", stream="compute", shape=(m, n, k), dtype="bf16", flops=flops)
    assert shaped.compute_time(op, cl.gpu) == pytest.approx(rows[0]["time_s_median"])
