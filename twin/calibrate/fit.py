"""Fit the cost model to measurements: kernel efficiency curves, collective latency and
bandwidth, interference, and run-to-run noise (numpy and scipy; torch-free).

Kernels (roofline, Williams et al. 2009): t = max(F / (P * E), B / (W * M)) + L, fitted per
kind (and dtype) by minimising a robust (soft-L1) loss of log(t_model / t_measured) over
log-parameters (scipy.optimize.least_squares, bounded). The achieved efficiency F / (P * t)
then rises with size through L; the cost model's extra knee F_half is left at 0 because
(F + F_half) / (P * E) is linear in F and cannot be told apart from L. Collectives:
t = alpha + beta * S per kind, group size and link class (Hockney's model), fitted on
relative residuals with a Huber loss (scipy.optimize.least_squares). Noise: the coefficient
of variation implied by the p10-p90 spread of repeats, (p90 - p10) / (2 * 1.2816 * median),
for a normal spread.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy.optimize import least_squares

from twin.cost import KernelCost

Z90 = 1.2815515655446004  # standard normal quantile at 0.9


@dataclass(frozen=True)
class KernelPoint:
    flops: float
    bytes: float
    time_s: float


@dataclass(frozen=True)
class FitResult:
    """A fitted model with its residuals (relative: t_model / t_measured - 1)."""

    params: dict
    residuals: list[float]

    @property
    def median_abs_residual(self) -> float:
        return float(np.median(np.abs(self.residuals))) if self.residuals else 0.0

    @property
    def max_abs_residual(self) -> float:
        return float(np.max(np.abs(self.residuals))) if self.residuals else 0.0


def kernel_time(p: dict, flops: np.ndarray, nbytes: np.ndarray, peak: float, bw: float) -> np.ndarray:
    """The cost model's compute time for arrays of FLOPs and bytes."""
    eff = p["efficiency"] * (flops / (flops + p["half_flops"]) if p["half_flops"] else 1.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        t_f = np.where(flops > 0, flops / (peak * eff), 0.0)
    t_m = nbytes / (bw * p["mem_efficiency"])
    return np.maximum(t_f, t_m) + p["launch_us"] * 1e-6


def fit_kernel(points: list[KernelPoint], peak_flops: float, hbm_Bps: float,
               start: KernelCost | None = None, memory_bound: bool = False,
               fit_memory: bool = True) -> FitResult:
    """Largest efficiency, memory efficiency and launch overhead of one kernel kind.

    Compute-bound kinds fit E and L (and M from 4 points on, unless ``fit_memory`` is
    false: attention's byte count, Q, K, V and O, is only a lower bound of its traffic);
    memory-bound kinds (``memory_bound``: elementwise, optimizer) fit M and L, E keeping
    ``start``'s value.
    E is bounded by 4 and M by 10 (caches can beat the nominal memory bandwidth)."""
    if not points:
        raise ValueError("no measurements to fit")
    start = start or KernelCost()
    F = np.array([p.flops for p in points], float)
    B = np.array([p.bytes for p in points], float)
    T = np.array([p.time_s for p in points], float)
    if memory_bound:
        free = ["mem_efficiency", "launch_us"]
    else:
        free = ["efficiency", "launch_us"] + (["mem_efficiency"] if len(points) >= 4 and fit_memory
                                              else [])
    base = {"efficiency": start.efficiency, "half_flops": 0.0,
            "mem_efficiency": start.mem_efficiency, "launch_us": max(start.launch_us, 0.1)}

    def unpack(x):
        p = dict(base)
        for name, v in zip(free, x):
            p[name] = float(math.exp(v))
        return p

    bounds = {"efficiency": 4.0, "mem_efficiency": 10.0, "launch_us": 1e6}
    upper = np.log([bounds[n] for n in free])

    def residuals(x):
        return np.log(kernel_time(unpack(x), F, B, peak_flops, hbm_Bps) / T)

    best = None
    for scale in (1.0, 0.3, 3.0):
        x0 = np.log([base[n] * (scale if n in ("efficiency", "mem_efficiency") else 1.0)
                     for n in free])
        x0 = np.minimum(x0, upper - 1e-9)
        sol = least_squares(residuals, x0, bounds=(-np.inf, upper), loss="soft_l1", f_scale=0.05)
        if best is None or sol.cost < best[1]:
            best = (sol.x, sol.cost)
    p = unpack(best[0])
    for n in free:
        p[n] = min(p[n], bounds[n])
    res = kernel_time(p, F, B, peak_flops, hbm_Bps) / T - 1
    return FitResult(params=p, residuals=[float(r) for r in res])


def fit_latency_bandwidth(sizes: list[float], times: list[float]) -> FitResult:
    """t = alpha + beta * S on relative residuals with a Huber loss (alpha >= 0, beta > 0)."""
    S = np.asarray(sizes, float)
    T = np.asarray(times, float)
    if len(S) < 2:
        raise ValueError("a latency/bandwidth fit needs at least two message sizes")
    A = np.stack([np.ones_like(S), S], axis=1)
    # a start from ordinary least squares on relative residuals; scaled unknowns (seconds
    # and seconds per byte differ by ten orders of magnitude)
    coef, *_ = np.linalg.lstsq(A / T[:, None], np.ones_like(T), rcond=None)
    scale = np.array([max(abs(coef[0]), T.min() * 1e-3), max(abs(coef[1]), 1e-15)])
    x0 = np.clip(np.maximum(coef, 0.0) / scale, 0.0, None) + [0.0, 1e-6]

    def residuals(x):
        return (A @ (x * scale)) / T - 1

    sol = least_squares(residuals, x0, bounds=([0.0, 1e-12], np.inf), loss="huber", f_scale=0.02)
    alpha, beta = sol.x * scale
    res = (A @ [alpha, beta]) / T - 1
    return FitResult(params={"alpha_s": float(alpha), "beta_s_per_byte": float(beta)},
                     residuals=[float(r) for r in res])


def cv_from_spread(median: float, p10: float, p90: float) -> float:
    """Coefficient of variation of a normal spread with these quantiles."""
    if median <= 0:
        return 0.0
    return max(0.0, (p90 - p10) / (2 * Z90 * median))


def robust_cv(rows: list[tuple[float, float, float]]) -> float:
    """Median of per-point CVs (median, p10, p90): one number for a family of measurements."""
    cvs = [cv_from_spread(*r) for r in rows if r[0] > 0]
    return float(np.median(cvs)) if cvs else 0.0


def weighted_median(values: list[float], weights: list[float]) -> float:
    """The value below which half the total weight lies."""
    order = np.argsort(values)
    v, w = np.asarray(values, float)[order], np.asarray(weights, float)[order]
    return float(v[np.searchsorted(np.cumsum(w), 0.5 * w.sum())])
