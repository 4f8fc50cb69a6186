"""Twin vs real: two traces of one schedule joined by (rank, step, op), drawn lane beside lane,
with the residual of every matched op's duration per op kind."""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import plotly.graph_objects as go

from twin.metrics import MEMORY
from twin.report import style
from twin.report.html import kv_table
from twin.report.lod import add_lod
from twin.report.timeline import (
    GL_SPANS,
    HOVER,
    MAX_SPANS,
    Lanes,
    add_bars,
    height_for,
    layout,
    lod_series,
    x_range,
)
from twin.trace import Span, Trace
from twin.vocab import COMPUTE_KINDS

MAX_SCATTER = 20_000
"""Points in the duration scatter (every k-th pair beyond this)."""


@dataclass
class Join:
    """The two traces' spans matched by (rank, step, op)."""

    pairs: list[tuple[Span, Span]]
    only_a: list[Span]
    only_b: list[Span]

    @property
    def complete(self) -> bool:
        return not self.only_a and not self.only_b


def join(a: Trace, b: Trace) -> Join:
    """Match every span of ``a`` with the span of ``b`` that has the same (rank, step, op).

    Raises if a key repeats within one trace: then the join would be a guess."""
    def index(t: Trace, which: str) -> dict[tuple, Span]:
        out: dict[tuple, Span] = {}
        for s in t.spans:
            key = (s.rank, s.step, s.op)
            if key in out:
                raise ValueError(f"{which} trace has two spans for rank {s.rank}, step {s.step}, "
                                 f"op {s.op!r}; op names must be unique per rank and step")
            out[key] = s
        return out

    ia, ib = index(a, "the first"), index(b, "the second")
    pairs = [(s, ib[k]) for k, s in ia.items() if k in ib]
    return Join(pairs, [s for k, s in ia.items() if k not in ib],
                [s for k, s in ib.items() if k not in ia])


def kind_of(s: Span) -> str:
    """Residual class: compute kind, collective kind (group), send, recv."""
    return f"{s.kind} ({s.group})" if s.group and s.kind not in ("send", "recv") else s.kind


def residuals(j: Join) -> dict[str, np.ndarray]:
    """Per op kind: rows of (duration a, duration b) in microseconds, timed ops only."""
    rows: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for a, b in j.pairs:
        if a.kind not in MEMORY:
            rows[kind_of(a)].append((a.dur_us, b.dur_us))
    return {k: np.array(v, dtype=float).reshape(len(v), 2) for k, v in sorted(rows.items())}


def residual_table(res: dict[str, np.ndarray], names: tuple[str, str]) -> str:
    """Per kind: count, total time on each side, and the median and spread of the error."""
    rows = []
    for k, v in res.items():
        ok = v[:, 0] > 0
        rel = (v[ok, 1] - v[ok, 0]) / v[ok, 0] * 100 if ok.any() else np.zeros(0)
        rows.append([k, f"{len(v):,}", style.duration(v[:, 0].sum() / 1e6),
                     style.duration(v[:, 1].sum() / 1e6),
                     f"{np.median(rel):+.1f} %" if len(rel) else "-",
                     f"{np.percentile(rel, 10):+.1f} / {np.percentile(rel, 90):+.1f} %"
                     if len(rel) else "-"])
    return kv_table(rows, ["op kind", "ops", f"total {names[0]}", f"total {names[1]}",
                           f"median ({names[1]} - {names[0]}) / {names[0]}", "p10 / p90"])


def residual_figure(res: dict[str, np.ndarray], names: tuple[str, str]) -> go.Figure:
    """Box per op kind of the relative duration error, in percent."""
    fig = go.Figure()
    for k, v in res.items():
        ok = v[:, 0] > 0
        rel = (v[ok, 1] - v[ok, 0]) / v[ok, 0] * 100
        fig.add_trace(go.Box(x=rel, name=k, orientation="h", boxpoints=False,
                             marker_color=style.color(k if k not in COMPUTE_KINDS else "forward"),
                             hovertemplate=f"{k}<br>%{{x:.2f}} %<extra></extra>"))
    fig.add_vline(x=0, line={"color": "#444", "width": 1})
    fig.update_layout(title={"text": f"residual per op kind: ({names[1]} - {names[0]}) / {names[0]}",
                             "font": {"size": 14}}, xaxis_title="duration error (%)",
                      showlegend=False, height=int(160 + 30 * max(len(res), 2)),
                      margin={"l": 170, "r": 20, "t": 50, "b": 45}, plot_bgcolor="#fbfbfb")
    return fig


def scatter_figure(res: dict[str, np.ndarray], names: tuple[str, str]) -> go.Figure:
    """Duration on one side against the other, log-log, with the y = x line."""
    fig = go.Figure()
    total = sum(len(v) for v in res.values())
    every = max(1, -(-total // MAX_SCATTER))
    kind = go.Scattergl if total > 5000 else go.Scatter  # WebGL only where SVG would be slow
    lo, hi = np.inf, 0.0
    for k, v in res.items():
        v = v[::every]
        v = v[(v[:, 0] > 0) & (v[:, 1] > 0)]
        if not len(v):
            continue
        lo, hi = min(lo, v.min()), max(hi, v.max())
        fig.add_trace(kind(x=v[:, 0], y=v[:, 1], mode="markers", name=k,
                                   marker={"size": 5, "opacity": 0.6, "color": style.color(
                                       k if " (" in k or k in ("send", "recv") else "forward")}))
    if hi > 0:
        fig.add_trace(go.Scatter(x=[lo, hi], y=[lo, hi], mode="lines", name="y = x",
                                 line={"color": "#444", "dash": "dash", "width": 1}))
    fig.update_layout(title={"text": f"op durations: {names[1]} against {names[0]}"
                             + (f" (every {every}th op)" if every > 1 else ""), "font": {"size": 14}},
                      xaxis={"type": "log", "title": f"{names[0]} (us)"},
                      yaxis={"type": "log", "title": f"{names[1]} (us)"}, height=480,
                      margin={"l": 70, "r": 20, "t": 50, "b": 50}, plot_bgcolor="#fbfbfb")
    return fig


def aligned(j: Join) -> tuple[list[Span], list[Span]]:
    """Timed spans of both sides, each step of the second shifted to start where the first's does."""
    start_a: dict[int, float] = {}
    start_b: dict[int, float] = {}
    for a, b in j.pairs:
        start_a[a.step] = min(start_a.get(a.step, a.start_us), a.start_us)
        start_b[b.step] = min(start_b.get(b.step, b.start_us), b.start_us)
    sa, sb = [], []
    for a, b in j.pairs:
        if a.kind in MEMORY:
            continue
        shift = start_a[a.step] - start_b[b.step]
        sa.append(a)
        sb.append(dataclasses.replace(b, start_us=b.start_us + shift, end_us=b.end_us + shift))
    return sa, sb


def side_by_side(j: Join, names: tuple[str, str], max_spans: int = MAX_SPANS) \
        -> tuple[go.Figure | tuple[go.Figure, str], str]:
    """Each rank's lanes twice, one under the other: the first trace, then the second."""
    sa, sb = aligned(j)
    note = ""
    if len(sa) * 2 > max_spans:
        steps = sorted({s.step for s in sa})
        keep = set(steps[:max(1, int(len(steps) * max_spans / (2 * len(sa))))])
        sa = [s for s in sa if s.step in keep]
        sb = [s for s in sb if s.step in keep]
        note = f"showing {len(keep)} of {len(steps)} steps (max_spans)"
    lanes = Lanes.of([(names[0], sa), (names[1], sb)])
    height, line_px = height_for(len(lanes.labels))
    fig = go.Figure()
    lane_a = lambda s: lanes.index[(s.rank, s.stream, 0)]  # noqa: E731
    lane_b = lambda s: lanes.index[(s.rank, s.stream, 1)]  # noqa: E731
    after = ""
    if len(sa) * 2 > GL_SPANS:
        series = lod_series(sa, lane_a) + lod_series(sb, lane_b, 0.7, False, f" · {names[1]}")
        after = add_lod(fig, series, len(lanes.labels), x_range(sa + sb), line_px, HOVER)
    else:
        add_bars(fig, sa, lane_a)
        add_bars(fig, sb, lane_b, opacity=0.7, legend=False)
    layout(fig, lanes, f"{names[0]} and {names[1]} lane by lane (each step of {names[1]} shifted "
                       f"to start with {names[0]}'s)", height)
    return ((fig, after) if after else fig), note


def match_text(j: Join, names: tuple[str, str]) -> str:
    """One line on how complete the join is (the overlay is only as good as it)."""
    text = f"{len(j.pairs):,} ops matched by (rank, step, op)"
    if j.complete:
        return text + ": every op of each trace has its partner."
    miss = []
    for which, spans in ((names[0], j.only_a), (names[1], j.only_b)):
        if spans:
            ex = spans[0]
            miss.append(f"{len(spans):,} only in {which} (e.g. rank {ex.rank} step {ex.step} "
                        f"{ex.op!r})")
    return text + "; " + "; ".join(miss) + ". Are both runs of the same schedule and steps?"
