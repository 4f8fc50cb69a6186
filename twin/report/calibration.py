"""Calibration: benchmark points (``paratwin bench`` CSVs) against the cost model, log-log.

The report draws, it never simulates: the model comes as measured-vs-modelled rows
(``twin.calibrate.predict.MODELLED_COLUMNS``), from the directory's ``modelled.csv``
(written by ``paratwin calibrate``) or from a ``Model`` callable the caller hands in (the
CLI's computes the rows of a bare bench directory on the cluster it ran on). Collectives:
measured median time per message size (p10-p90 as error bars), one colour per group size,
the model as a line through the same sizes. Kernels: time against FLOPs (bytes for
memory-bound kinds), measured and modelled.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from twin.calibrate.profile import read_csv, read_modelled
from twin.report.rundir import Run, csv_kind

SIZE_COLORS = ("#3366CC", "#DC3912", "#FF9900", "#109618", "#990099", "#0099C6", "#DD4477")

Model = Callable[[Run], tuple[list[dict], str]]
"""A run's measured-vs-modelled rows and a note on the model (the CLI's: paratwin.verbs.report)."""


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


def collective_figure(rows: list[dict], model: list[dict]) -> go.Figure:
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
            line = sorted((m for m in model if str(m["kind"]) == kind and m.get("table") ==
                           "collective" and m.get("group_size") == n), key=lambda m: m["bytes"])
            if not line:
                continue
            fig.add_trace(go.Scatter(
                x=[m["bytes"] for m in line], y=[m["time_s_model"] * 1e6 for m in line],
                mode="lines", line={"color": c, "width": 1.5}, name=f"{name} twin",
                legendgroup=name, showlegend=i == 0,
                hovertemplate=f"{kind}, {name}<br>%{{x:.4s}}B: %{{y:,.1f}} us<extra>twin</extra>"),
                row=row, col=col)
        fig.update_xaxes(type="log", title_text="message size (B)", row=row, col=col)
        fig.update_yaxes(type="log", title_text="time (us)", row=row, col=col)
    fig.update_layout(title={"text": "collectives: measured (points, p10-p90 bars) and the twin "
                             "(lines)", "font": {"size": 14}}, height=int(120 + 330 * nr),
                      margin={"l": 60, "r": 20, "t": 70, "b": 50}, plot_bgcolor="#fbfbfb")
    return fig


def kernel_figure(rows: list[dict], model: list[dict]) -> go.Figure:
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
            line = sorted((m for m in model if str(m["kind"]) == kind and m.get("table") ==
                           "kernel" and str(m.get("dtype", "")) == dt and float(m.get(axis) or 0) > 0),
                          key=lambda m: float(m[axis]))
            if not line:
                continue
            fig.add_trace(go.Scatter(
                x=[float(m[axis]) for m in line], y=[m["time_s_model"] * 1e6 for m in line],
                mode="lines+markers",
                line={"color": c, "width": 1.5}, marker={"symbol": "circle-open", "size": 8},
                name=f"{name} model", legendgroup=name, showlegend=i == 0,
                hovertemplate="%{y:,.1f} us<extra>model</extra>"), row=row, col=col)
        fig.update_xaxes(type="log", title_text="FLOPs" if use_flops else "bytes moved", row=row, col=col)
        fig.update_yaxes(type="log", title_text="time (us)", row=row, col=col)
    fig.update_layout(title={"text": "kernels: measured (points) and the cost model (lines)",
                             "font": {"size": 14}}, height=int(120 + 330 * nr),
                      margin={"l": 60, "r": 20, "t": 70, "b": 50}, plot_bgcolor="#fbfbfb")
    return fig


def calibration_figures(run: Run, model: Model | None = None) -> tuple[list[go.Figure], str]:
    """The figures of one directory's benchmark points (its bench CSVs, else its
    modelled.csv) with the model drawn beside them, and a note on the model used."""
    coll = [r for p in run.bench_csvs if csv_kind(p) == "collective" for r in read_csv(p)]
    kern = [r for p in run.bench_csvs if csv_kind(p) == "kernel" for r in read_csv(p)]
    if model is not None:
        rows, note = model(run)
    elif run.modelled_path is not None:
        rows, note = read_modelled(run.modelled_path), \
            f"model: {run.modelled_path.name} (the profile paratwin calibrate fitted there)"
    else:
        rows, note = [], ("no modelled.csv here (paratwin calibrate writes one), so only the "
                          "measured points are drawn; `paratwin report` draws the model")
    if not coll and not kern:  # a calibrate directory whose bench CSVs stayed in bench/
        coll = [r for r in rows if r.get("table") == "collective"]
        kern = [r for r in rows if r.get("table") == "kernel"]
    figs = []
    if coll:
        figs.append(collective_figure(coll, rows))
    if kern:
        figs.append(kernel_figure(kern, rows))
    return figs, note
