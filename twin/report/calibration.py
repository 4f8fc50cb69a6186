"""Calibration: benchmark points (``paratwin bench`` CSVs) against the cost model, log-log.

Collectives: measured median time per message size (p10-p90 as error bars), one colour per
group size, against the twin's own prediction: the collective simulated alone on the
cluster (same algorithms, links and latencies as a full simulation). Kernels: measured
time per FLOP (bytes for memory-bound kinds) against ``CostModel.compute_time`` of an op
with the measured kind, shape, dtype, FLOPs and bytes.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections import defaultdict
from collections.abc import Callable

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from twin.calibrate.predict import base_kind, collective_time, kernel_time
from twin.calibrate.profile import read_csv
from twin.cost import CostModel, default_cost_model
from twin.report.rundir import Run, csv_kind
from twin.rundir import BENCH_META
from twin.schedule.ir import COLLECTIVE_KINDS, COMPUTE_KINDS
from twin.spec import ClusterSpec

MODELLED = (*COLLECTIVE_KINDS, "sendrecv")
SIZE_COLORS = ("#3366CC", "#DC3912", "#FF9900", "#109618", "#990099", "#0099C6", "#DD4477")


Presets = Callable[[str], ClusterSpec]
"""Cluster presets by name (the CLI's conf/cluster/; the report never reads the config tree)."""


def bench_cluster(run: Run, name: str | None = None,
                  presets: Presets | None = None) -> tuple[ClusterSpec | None, str]:
    """The cluster the benchmarks ran on: ``name`` (a preset), the directory's config, or,
    for a gloo bench (meta.json), cpu_local with its world size; else none. Presets come
    from ``presets`` (none without it)."""
    if name:
        if presets is None:
            raise ValueError(f"cluster={name}: no presets to look it up in (pass presets=)")
        return presets(name), f"cluster {name} (given)"
    if run.cluster is not None:
        return run.cluster, f"cluster {run.cluster.name} (config.yaml)"
    meta_path = run.path / BENCH_META
    try:
        meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    except (OSError, json.JSONDecodeError):
        meta = {}
    if meta.get("backend") == "gloo" and presets is not None:
        base = presets("cpu_local")
        n = int(meta.get("world_size") or base.gpus_per_node)
        return dataclasses.replace(base, gpus_per_node=n), \
            f"cluster cpu_local with {n} ranks (meta.json says gloo; give cluster=NAME otherwise)"
    return None, ""


def run_profile(run: Run, cluster: ClusterSpec | None) -> tuple[CostModel | None, str]:
    """The run's profile YAML, else the cluster's published defaults, else none."""
    if run.profile_path is not None:
        cost = CostModel.load(run.profile_path)
        return cost, f"profile {run.profile_path.name} ({cost.name})"
    if cluster is not None:
        return default_cost_model(cluster), "the cluster's default cost model (no profile YAML)"
    return None, ""


def _errors(rows: list[dict]) -> dict | None:
    if not all(isinstance(r.get("time_s_p10"), float) and isinstance(r.get("time_s_p90"), float)
               for r in rows):
        return None
    return {"type": "data", "symmetric": False,
            "array": [(r["time_s_p90"] - r["time_s_median"]) * 1e6 for r in rows],
            "arrayminus": [(r["time_s_median"] - r["time_s_p10"]) * 1e6 for r in rows],
            "thickness": 1, "width": 2}


def _grid(kinds: list[str]) -> tuple[int, int]:
    cols = min(3, len(kinds))
    return math.ceil(len(kinds) / cols), cols


def _panels(rows: list[dict]):
    """Rows by kind, the kinds, and a grid of one log-log panel per kind."""
    by_kind: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        by_kind[str(r["kind"])].append(r)
    kinds = sorted(by_kind)
    nr, nc = _grid(kinds)
    fig = make_subplots(rows=nr, cols=nc, subplot_titles=kinds, horizontal_spacing=0.07,
                        vertical_spacing=0.12)
    return by_kind, kinds, nr, nc, fig


def collective_figure(rows: list[dict], cluster: ClusterSpec | None, cost: CostModel | None) \
        -> go.Figure:
    """One log-log panel per collective kind: measured points and the twin's line per group size."""
    by_kind, kinds, nr, nc, fig = _panels(rows)
    sizes = sorted({int(r["group_size"]) for r in rows})
    for i, kind in enumerate(kinds):
        row, col = i // nc + 1, i % nc + 1
        for j, n in enumerate(sizes):
            pts = sorted((r for r in by_kind[kind] if int(r["group_size"]) == n),
                         key=lambda r: r["bytes"])
            if not pts:
                continue
            c, name = SIZE_COLORS[j % len(SIZE_COLORS)], f"{n} ranks"
            fig.add_trace(go.Scatter(
                x=[p["bytes"] for p in pts], y=[p["time_s_median"] * 1e6 for p in pts],
                error_y=_errors(pts), mode="markers", marker={"color": c, "size": 7},
                name=f"{name} measured", legendgroup=name, showlegend=i == 0,
                hovertemplate=f"{kind}, {name}<br>%{{x:.4s}}B: %{{y:,.1f}} us<extra>measured</extra>"),
                row=row, col=col)
            if cluster is None or cost is None or n < 2 or kind not in MODELLED:
                continue
            lo, hi = pts[0]["bytes"], pts[-1]["bytes"]
            xs = np.geomspace(max(lo, 1.0), max(hi, lo * 2, 2.0), 24)
            ys = [collective_time(kind, n, x, cluster, cost) * 1e6 for x in xs]
            fig.add_trace(go.Scatter(
                x=xs, y=ys, mode="lines", line={"color": c, "width": 1.5}, name=f"{name} twin",
                legendgroup=name, showlegend=i == 0,
                hovertemplate=f"{kind}, {name}<br>%{{x:.4s}}B: %{{y:,.1f}} us<extra>twin</extra>"),
                row=row, col=col)
        fig.update_xaxes(type="log", title_text="message size (B)", row=row, col=col)
        fig.update_yaxes(type="log", title_text="time (us)", row=row, col=col)
    fig.update_layout(title={"text": "collectives: measured (points, p10-p90 bars) and the twin "
                             "(lines)", "font": {"size": 14}}, height=int(120 + 330 * nr),
                      margin={"l": 60, "r": 20, "t": 70, "b": 50}, plot_bgcolor="#fbfbfb")
    return fig


def kernel_figure(rows: list[dict], cluster: ClusterSpec | None, cost: CostModel | None) -> go.Figure:
    """One log-log panel per kernel kind: time against FLOPs (bytes if the kind has none)."""
    by_kind, kinds, nr, nc, fig = _panels(rows)
    dtypes = sorted({str(r.get("dtype", "")) for r in rows})
    for i, kind in enumerate(kinds):
        row, col = i // nc + 1, i % nc + 1
        use_flops = any(float(r.get("flops") or 0) > 0 for r in by_kind[kind])
        axis = "flops" if use_flops else "bytes"
        for j, dt in enumerate(dtypes):
            pts = sorted((r for r in by_kind[kind] if str(r.get("dtype", "")) == dt),
                         key=lambda r: float(r.get(axis) or 0))
            pts = [p for p in pts if float(p.get(axis) or 0) > 0]
            if not pts:
                continue
            c, name = SIZE_COLORS[j % len(SIZE_COLORS)], dt or "measured"
            xs = [float(p[axis]) for p in pts]
            fig.add_trace(go.Scatter(
                x=xs, y=[p["time_s_median"] * 1e6 for p in pts], error_y=_errors(pts),
                mode="markers", marker={"color": c, "size": 7}, name=f"{name} measured",
                legendgroup=name, showlegend=i == 0, text=[str(p.get("shape", "")) for p in pts],
                hovertemplate=f"{kind} {dt} %{{text}}<br>%{{x:.4s}}{'FLOP' if use_flops else 'B'}: "
                              "%{y:,.1f} us<extra>measured</extra>"), row=row, col=col)
            if cluster is None or cost is None or base_kind(kind) not in COMPUTE_KINDS:
                continue
            fig.add_trace(go.Scatter(
                x=xs, y=[kernel_time(p, cluster, cost) * 1e6 for p in pts], mode="lines+markers",
                line={"color": c, "width": 1.5}, marker={"symbol": "circle-open", "size": 8},
                name=f"{name} model", legendgroup=name, showlegend=i == 0,
                hovertemplate="%{y:,.1f} us<extra>model</extra>"), row=row, col=col)
        fig.update_xaxes(type="log", title_text="FLOPs" if use_flops else "bytes moved", row=row, col=col)
        fig.update_yaxes(type="log", title_text="time (us)", row=row, col=col)
    fig.update_layout(title={"text": "kernels: measured (points) and the cost model (lines)",
                             "font": {"size": 14}}, height=int(120 + 330 * nr),
                      margin={"l": 60, "r": 20, "t": 70, "b": 50}, plot_bgcolor="#fbfbfb")
    return fig


def calibration_figures(run: Run, cluster_name: str | None = None,
                        presets: Presets | None = None) -> tuple[list[go.Figure], str]:
    """The figures of one directory's benchmark CSVs, and a note on the model used."""
    cluster, on = bench_cluster(run, cluster_name, presets)
    cost, where = run_profile(run, cluster)
    coll = [r for p in run.bench_csvs if csv_kind(p) == "collective" for r in read_csv(p)]
    kern = [r for p in run.bench_csvs if csv_kind(p) == "kernel" for r in read_csv(p)]
    figs = []
    if coll:
        figs.append(collective_figure(coll, cluster, cost))
    if kern:
        figs.append(kernel_figure(kern, cluster, cost))
    note = f"model: {where} on {on}" if cluster is not None and cost is not None else \
        ("the directory does not say which cluster the benchmarks ran on, so only the measured "
         "points are drawn; give cluster=NAME (a conf/cluster preset) to draw the model")
    return figs, note
