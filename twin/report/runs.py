"""Measured runs against the twin: predicted vs measured step time, log-log, one colour per
model, the error of each row on hover; the diagonal and a +-10% band.

Drawn from ``runs_modelled.csv`` (``paratwin calibrate runs=`` or ``paratwin validate
runs=``): line, name, model, measured_s, predicted_s, error, split.
"""

from __future__ import annotations

import csv
from pathlib import Path

import plotly.graph_objects as go

PALETTE = ("#3366CC", "#DC3912", "#109618", "#990099", "#0099C6", "#DD4477", "#66AA00",
           "#B82E2E", "#316395", "#994499", "#22AA99", "#AAAA11")
FILE = "runs_modelled.csv"


def read_rows(path: Path) -> list[dict]:
    """The rows that carry a prediction (numbers parsed)."""
    out = []
    with Path(path).open(newline="") as fh:
        for r in csv.DictReader(fh):
            try:
                m, p = float(r["measured_s"]), float(r["predicted_s"])
            except (KeyError, TypeError, ValueError):
                continue
            if m > 0 and p > 0:
                out.append({**r, "measured_s": m, "predicted_s": p, "error": p / m - 1})
    return out


def scatter(rows: list[dict]) -> go.Figure:
    """Predicted against measured step time, one trace per model."""
    fig = go.Figure()
    models = sorted({str(r.get("model") or "runs") for r in rows})
    lo = min(min(r["measured_s"], r["predicted_s"]) for r in rows) * 1e3
    hi = max(max(r["measured_s"], r["predicted_s"]) for r in rows) * 1e3
    for band, dash in ((1.0, "solid"), (1.1, "dot"), (0.9, "dot")):
        fig.add_trace(go.Scatter(x=[lo, hi], y=[lo * band, hi * band], mode="lines",
                                 line={"color": "#999", "width": 1, "dash": dash},
                                 showlegend=False, hoverinfo="skip"))
    for k, model in enumerate(models):
        pts = [r for r in rows if str(r.get("model") or "runs") == model]
        fig.add_trace(go.Scatter(
            x=[r["measured_s"] * 1e3 for r in pts], y=[r["predicted_s"] * 1e3 for r in pts],
            mode="markers", name=model, marker={"color": PALETTE[k % len(PALETTE)], "size": 6,
                                               "opacity": 0.75},
            text=[f"{r.get('name') or 'line ' + str(r.get('line'))}: {r['error']:+.1%}"
                  + (f" ({r['split']})" if r.get("split") else "") for r in pts],
            hovertemplate="%{text}<br>measured %{x:,.1f} ms, twin %{y:,.1f} ms<extra>"
                          + model + "</extra>"))
    fig.update_xaxes(type="log", title_text="measured step time (ms)")
    fig.update_yaxes(type="log", title_text="twin's step time (ms)")
    fig.update_layout(title={"text": "measured runs: the twin against each (diagonal: exact; "
                                     "dotted: +-10%)", "font": {"size": 14}},
                      height=560, margin={"l": 60, "r": 20, "t": 60, "b": 50},
                      plot_bgcolor="#fbfbfb")
    return fig
