"""Turn `paratwin bench` CSVs and interference measurements into a calibration profile."""

from __future__ import annotations

import csv
import dataclasses
import json
import re
from collections import defaultdict
from pathlib import Path

import numpy as np

from twin.calibrate.fit import (
    FitResult,
    KernelPoint,
    fit_kernel,
    fit_latency_bandwidth,
    kernel_time,
    robust_cv,
)
from twin.cost import SHAPE_RANGE, CostModel, KernelCost, default_cost_model
from twin.kernelshape import gemm_aligned, shape_key, timed_flops
from twin.rundir import BENCH_META
from twin.schedule.ir import Op
from twin.spec import ClusterSpec

KERNEL_KIND = {"gemm": "gemm", "attention": "attention", "attention.bwd": "attention",
               "elementwise": "elementwise", "optimizer": "optimizer"}


def read_csv(path: Path) -> list[dict]:
    """Rows of a `paratwin bench` CSV: numbers parsed, other columns kept as text, rows
    without a positive median time dropped; a missing or foreign file says so."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"{path} does not exist; run `paratwin bench out_dir={path.parent}` first")
    with open(path, newline="") as fh:
        rows = list(csv.DictReader(fh))
    need = {"kind", "time_s_median", "time_s_p10", "time_s_p90"}
    if rows and not need <= {k.strip() for k in rows[0] if k}:
        raise ValueError(f"{path} is not a paratwin bench CSV (missing {sorted(need - set(rows[0]))})")
    out = []
    for r in rows:
        d = {}
        for k, v in r.items():
            if k is None:
                continue
            try:
                d[k.strip()] = float(v)
            except (TypeError, ValueError):
                d[k.strip()] = (v or "").strip()
        if isinstance(d.get("time_s_median"), float) and d["time_s_median"] > 0:
            out.append(d)
    return out


def read_modelled(path: Path) -> list[dict]:
    """The rows of a ``modelled.csv`` (``predict.MODELLED_COLUMNS``) that carry a model time."""
    return [r for r in read_csv(Path(path)) if isinstance(r.get("time_s_model"), float)]


def base_kind(kind) -> str:
    """'attention.bwd' -> 'attention': the cost model's kind of a benchmarked kernel."""
    return str(kind).split(".")[0]


def bench_op(row: dict, dtype: str) -> Op:
    """The op a kernel-sweep row timed: its cost-model kind ('attention.bwd' -> 'attention'),
    shape (parsed from '1x32x8x4096x128x1'), dtype (``dtype`` where the row has none), FLOPs
    and bytes."""
    return Op(name="bench", kind=base_kind(row["kind"]), stream="compute",
              shape=tuple(int(x) for x in re.findall(r"\d+", str(row.get("shape", "")))),
              dtype=str(row.get("dtype") or dtype), flops=float(row.get("flops") or 0.0),
              bytes=float(row.get("bytes") or 0.0))


def fit_kernels(rows: list[dict], cluster: ClusterSpec, base: CostModel, dtype: str):
    """KernelCost per (dtype, kind) and the residuals; ``dtype``'s fits become the defaults.
    Where the rows carry the host's time to issue a call (``host_s_median``: a GPU sweep), a
    kind's ``host_us`` is the median of its rows'; else it stays 0 (on CPU the call is the
    host's own work, already in its time). GEMMs of unaligned n or k (kernelshape.gemm_aligned)
    are left out of their kind's fit and give its ``unaligned_efficiency`` instead."""
    groups: dict[tuple[str, str], list[KernelPoint]] = defaultdict(list)
    unaligned: dict[tuple[str, str], list[KernelPoint]] = defaultdict(list)
    hosts: dict[tuple[str, str], list[float]] = defaultdict(list)
    for r in rows:
        kind = KERNEL_KIND.get(str(r["kind"]))
        if kind is None or r["dtype"] not in cluster.gpu.peak_tflops:
            continue
        # by the FLOPs the cost model times it by (a causal attention skips the masked half)
        op = bench_op(r, dtype)
        point = KernelPoint(timed_flops(op), r["bytes"], r["time_s_median"])
        aligned = kind != "gemm" or gemm_aligned(op)
        (groups if aligned else unaligned)[(str(r["dtype"]), kind)].append(point)
        if isinstance(r.get("host_s_median"), float):
            hosts[(str(r["dtype"]), kind)].append(r["host_s_median"])
    by_dtype: dict[str, dict[str, KernelCost]] = defaultdict(dict)
    fits: dict[str, FitResult] = {}
    for (dt, kind), points in sorted(groups.items()):
        fit = fit_kernel(points, cluster.gpu.peak_flops(dt), cluster.gpu.hbm_bw_GBps * 1e9,
                         base.kernel(kind), memory_bound=kind in ("elementwise", "optimizer"),
                         fit_memory=kind != "attention")
        if unaligned[(dt, kind)]:
            fit = fit_unaligned(fit, unaligned[(dt, kind)], cluster.gpu.peak_flops(dt),
                                cluster.gpu.hbm_bw_GBps * 1e9)
        if hosts[(dt, kind)]:
            fit.params["host_us"] = float(np.median(hosts[(dt, kind)])) * 1e6
        by_dtype[dt][kind] = KernelCost(**fit.params)
        fits[f"{kind}/{dt}"] = fit
    defaults = {k: v for k, v in by_dtype.get(dtype, {}).items()}
    return defaults, dict(by_dtype), fits


def fit_unaligned(fit: FitResult, points: list[KernelPoint], peak: float, hbm_Bps: float) -> FitResult:
    """``fit`` (of a GEMM kind's aligned points) with its ``unaligned_efficiency``: the median
    over the unaligned ``points`` of the share of the fitted efficiency their compute time
    shows (launch excluded; at most 1), and their residuals under it added."""
    p, launch = fit.params, fit.params["launch_us"] * 1e-6
    flops = np.array([pt.flops for pt in points])
    compute = kernel_time(p, flops, np.zeros(len(points)), peak, hbm_Bps) - launch
    shares = [c / (pt.time_s - launch) for c, pt in zip(compute, points) if pt.time_s > launch and c > 0]
    if not shares:
        return fit
    params = {**p, "unaligned_efficiency": min(1.0, float(np.median(shares)))}
    slowed = {**params, "efficiency": params["efficiency"] * params["unaligned_efficiency"]}
    modelled = kernel_time(slowed, flops, np.array([pt.bytes for pt in points]), peak, hbm_Bps)
    res = [float(t / pt.time_s - 1) for t, pt in zip(modelled, points)]
    return FitResult(params=params, residuals=list(fit.residuals) + res)


def sweep_shape_factors(rows: list[dict], cluster: ClusterSpec, cost: CostModel) -> dict:
    """``CostModel.shape_factors`` of the swept GEMM shapes: measured over modelled time under
    ``cost`` (its fitted kernels), launch excluded, within the step fit's bounds; the shapes
    of a schedule that were swept are then timed as measured."""
    out = {}
    for r in rows:
        op = bench_op(r, "")
        if r["kind"] != "gemm" or len(op.shape) != 3 or op.dtype not in cluster.gpu.peak_tflops:
            continue
        launch = cost.kernel("gemm", op.dtype).launch_us * 1e-6
        model = cost.compute_time(op, cluster.gpu) - launch
        if model > 0 and r["time_s_median"] > launch:
            factor = (r["time_s_median"] - launch) / model
            out[shape_key(op)] = round(min(SHAPE_RANGE[1], max(SHAPE_RANGE[0], factor)), 6)
    return out


def fit_collectives(rows: list[dict], link: str = "intra"):
    """Latency/bandwidth per (kind, group size): the profile's collective_fits and residuals."""
    groups: dict[tuple[str, int], list[tuple[float, float]]] = defaultdict(list)
    for r in rows:
        groups[(str(r["kind"]), int(r["group_size"]))].append((r["bytes"], r["time_s_median"]))
    out, fits = {}, {}
    for (kind, n), pts in sorted(groups.items()):
        if len(pts) < 2:
            continue
        fit = fit_latency_bandwidth([p[0] for p in pts], [p[1] for p in pts])
        beta = fit.params["beta_s_per_byte"]
        out[f"{kind}/{link}/{n}"] = {
            "latency_us": fit.params["alpha_s"] * 1e6, "bw_GBps": 1 / beta / 1e9,
            "residual_median": fit.median_abs_residual, "residual_max": fit.max_abs_residual,
            "points": len(pts)}
        fits[f"{kind}/{link}/{n}"] = fit
    return out, fits


def build_profile(bench_dir: Path, cluster: ClusterSpec, name: str, dtype: str,
                  interference: dict | None = None) -> tuple[CostModel, dict]:
    """The fitted profile of a bench directory, and a summary of every fit's residuals."""
    base = default_cost_model(cluster)
    meta_path = bench_dir / BENCH_META
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    changes: dict = {}
    report: dict = {"kernels": {}, "collectives": {}}
    if (bench_dir / "kernels.csv").exists():
        krows = read_csv(bench_dir / "kernels.csv")
        defaults, by_dtype, kfits = fit_kernels(krows, cluster, base, dtype)
        changes.update(defaults)
        changes["kernels_by_dtype"] = by_dtype
        report["kernels"] = {k: {"params": f.params, "residual_median": f.median_abs_residual,
                                 "residual_max": f.max_abs_residual, "points": len(f.residuals)}
                             for k, f in kfits.items()}
        shapes = sweep_shape_factors(krows, cluster, dataclasses.replace(base, **changes))
        if shapes:
            changes["shape_factors"] = shapes
        timed = [(r["time_s_median"], r["time_s_p10"], r["time_s_p90"]) for r in krows
                 if r["time_s_median"] > 2e-3]
        changes["compute_cv"] = robust_cv(timed)
    if (bench_dir / "collectives.csv").exists():
        crows = read_csv(bench_dir / "collectives.csv")
        cfits, _ = fit_collectives(crows)
        changes["collective_fits"] = cfits
        report["collectives"] = cfits
        big = [(r["time_s_median"], r["time_s_p10"], r["time_s_p90"]) for r in crows
               if r["bytes"] >= 1 << 20]
        changes["comm_cv"] = robust_cv(big)
    if interference:
        k = interference["world_size"]
        slow = max(1.0, interference["gemm_concurrent_s"] / interference["gemm_alone_s"])
        cores = cluster.cores_per_node or k
        # the twin's shared cores: k busy ranks run at min(1, C/k); measured slowdown s -> C = k/s
        changes["cores_effective"] = min(float(cores), k / slow) if slow > 1.0 else float(cores)
        measured = max(0.0, interference["gemm_overlap_s"] / interference["gemm_concurrent_s"] - 1.0)
        if cluster.intra.kind == "shared_cpu":
            # the twin's shared cores already slow compute beside communication (gloo's copies
            # take core time): k ranks computing beside k transfers get C / 2k cores each
            c = changes["cores_effective"]
            changes["overlap_slowdown"] = 0.0
            modelled = min(1.0, c / k) / min(1.0, c / (2 * k)) - 1.0
        else:
            changes["overlap_slowdown"] = modelled = measured
        report["interference"] = {**interference, "cores_effective": changes["cores_effective"],
                                  "overlap_slowdown": changes["overlap_slowdown"],
                                  "overlap_measured": measured, "overlap_modelled": modelled}
    if not changes:
        raise ValueError(f"{bench_dir} holds neither kernels.csv nor collectives.csv")
    provenance = {"source": str(bench_dir), "cluster": cluster.name, **{
        k: meta.get(k) for k in ("host", "cpu", "gpus", "torch_version", "backend", "world_size",
                                 "date") if k in meta},
        "fit_residuals": {
            "kernels_median": median_or_none([v["residual_median"] for v in report["kernels"].values()]),
            "collectives_median": median_or_none([v["residual_median"]
                                           for v in report["collectives"].values()])}}
    profile = dataclasses.replace(base, name=name, provenance=provenance, **changes)
    return profile, report


def median_or_none(xs: list[float]) -> float | None:
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else None
