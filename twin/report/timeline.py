"""The timeline: one lane per rank and stream, bars coloured by phase or collective, idle shaded.

Bars are ``go.Bar(base=start, x=duration)`` on a linear microsecond axis (``px.timeline``
would force dates). Past ``GL_SPANS`` spans the figure switches to WebGL segments drawn at
the zoom's level of detail (twin/report/lod.py), so a 200,000-span trace stays responsive.
Past ``max_spans`` only the first steps are drawn.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import plotly.graph_objects as go

from twin.metrics import COMPUTE, MEMORY
from twin.report import style
from twin.report.lod import Series, add_lod
from twin.trace import Span, Trace

GL_SPANS = 4000
"""More timed spans than this: WebGL segments at the zoom's level of detail, not SVG bars."""
MAX_SPANS = 400_000
"""More than this: draw the first steps only (the note says which)."""
HOVER = ("<b>%{text}</b><br>rank %{customdata[0]:d} · step %{customdata[1]:d} · layer "
         "%{customdata[2]:d} · micro-batch %{customdata[3]:d}<br>bytes %{customdata[4]:.4s}B · "
         "FLOPs %{customdata[5]:.4s}<br>start %{customdata[6]:,.1f} us · duration "
         "%{customdata[7]:,.2f} us<extra>%{fullData.name}</extra>")


@dataclass
class Lanes:
    """Lane index of each (rank, stream, source) and the axis labels."""

    index: dict[tuple, int]
    labels: list[str]

    @classmethod
    def of(cls, sources: list[tuple[str, list[Span]]]) -> Lanes:
        keys = {(s.rank, s.stream, i) for i, (_, spans) in enumerate(sources) for s in spans}
        order = sorted(keys, key=lambda k: (k[0], style.stream_key(k[1]), k[2]))
        labels = [f"r{r} {st}" + (f" · {sources[i][0]}" if sources[i][0] else "")
                  for r, st, i in order]
        return cls({k: n for n, k in enumerate(order)}, labels)


def timed(spans: list[Span]) -> list[Span]:
    return [s for s in spans if s.kind not in MEMORY]


def limit_steps(trace: Trace, max_spans: int = MAX_SPANS) -> tuple[list[Span], str]:
    """The timed spans of as many whole steps as fit in ``max_spans`` (of the first ranks
    only, if one step alone is bigger), and a note when some are left out."""
    spans = timed(trace.spans)
    if len(spans) <= max_spans:
        return spans, ""
    per_step: dict[int, int] = defaultdict(int)
    for s in spans:
        per_step[s.step] += 1
    keep, total = set(), 0
    for step in sorted(per_step):
        if total + per_step[step] > max_spans:
            break
        keep.add(step)
        total += per_step[step]
    if not keep:  # one step is too big: its first ranks
        first = min(per_step)
        per_rank: dict[int, int] = defaultdict(int)
        for s in spans:
            if s.step == first:
                per_rank[s.rank] += 1
        ranks, total = set(), 0
        for r in sorted(per_rank):
            if ranks and total + per_rank[r] > max_spans:
                break
            ranks.add(r)
            total += per_rank[r]
        note = (f"showing ranks {min(ranks)}..{max(ranks)} of {len(per_rank)} in step {first} "
                f"({total:,} of {len(spans):,} spans; raise max_spans to draw more)")
        return [s for s in spans if s.step == first and s.rank in ranks], note
    note = (f"showing steps {min(keep)}..{max(keep)} of {len(per_step)} ({total:,} of "
            f"{len(spans):,} spans; raise max_spans to draw more)")
    return [s for s in spans if s.step in keep], note


def idle_gaps(spans: list[Span], min_fraction: float = 1e-3) -> list[Span]:
    """Gaps in each rank's compute within its step (pipeline bubbles, waits for comm), as
    spans of kind 'idle'. Gaps shorter than ``min_fraction`` of the step are dropped."""
    by_step: dict[int, list[Span]] = defaultdict(list)
    for s in spans:
        by_step[s.step].append(s)
    out: list[Span] = []
    for step, ss in sorted(by_step.items()):
        t0, t1 = min(s.start_us for s in ss), max(s.end_us for s in ss)
        floor = (t1 - t0) * min_fraction
        per_rank: dict[int, list[tuple[float, float]]] = defaultdict(list)
        for s in ss:
            if s.kind in COMPUTE:
                per_rank[s.rank].append((s.start_us, s.end_us))
        for rank, iv in sorted(per_rank.items()):
            cursor = t0
            for a, b in sorted(iv):
                if a - cursor > floor:
                    out.append(Span(rank, step, f"idle {cursor - t0:,.0f}-{a - t0:,.0f} us into step",
                                    "idle", "compute", cursor, a, phase="idle"))
                cursor = max(cursor, b)
            if t1 - cursor > floor:
                out.append(Span(rank, step, f"idle {cursor - t0:,.0f}-{t1 - t0:,.0f} us into step",
                                "idle", "compute", cursor, t1, phase="idle"))
    return out


def _arrays(spans: list[Span], lane_of) -> dict[str, np.ndarray]:
    n = len(spans)
    start = np.fromiter((s.start_us for s in spans), float, n)
    end = np.fromiter((s.end_us for s in spans), float, n)
    lane = np.fromiter((lane_of(s) for s in spans), float, n)
    custom = np.array([(s.rank, s.step, s.layer, s.mb, s.bytes, s.flops, s.start_us,
                        s.end_us - s.start_us) for s in spans], dtype=float).reshape(n, 8)
    return {"start": start, "end": end, "lane": lane, "custom": custom,
            "text": [s.op for s in spans]}


def by_category(spans: list[Span]) -> dict[str, list[Span]]:
    """Spans per legend entry, in legend order (idle first: it lies under the ops)."""
    groups: dict[str, list[Span]] = defaultdict(list)
    for s in spans:
        groups["idle" if s.kind == "idle" else style.category(s)].append(s)
    return {c: groups[c] for c in sorted(groups, key=lambda c: (c != "idle", style.category_key(c)))}


def add_bars(fig: go.Figure, spans: list[Span], lane_of, opacity: float = 1.0,
             legend: bool = True) -> None:
    """One SVG bar trace per category of ``spans``."""
    for cat, members in by_category(spans).items():
        a = _arrays(members, lane_of)
        fig.add_trace(go.Bar(
            orientation="h", base=a["start"], x=a["end"] - a["start"], y=a["lane"], width=0.8,
            name=cat, legendgroup=cat, showlegend=legend, marker_color=style.color(cat),
            opacity=opacity * (0.9 if cat == "idle" else 1.0), marker_line_width=0, text=a["text"],
            textposition="none", customdata=a["custom"], hovertemplate=HOVER))


def lod_series(spans: list[Span], lane_of, opacity: float = 1.0, legend: bool = True,
               suffix: str = "") -> list[Series]:
    """The level-of-detail series of ``spans``, one per category."""
    return [Series(cat + suffix, style.color(cat), members, lane_of,
                   opacity * (0.9 if cat == "idle" else 1.0), legend, group=cat)
            for cat, members in by_category(spans).items()]


def x_range(spans: list[Span]) -> tuple[float, float]:
    t0, t1 = min(s.start_us for s in spans), max(s.end_us for s in spans)
    pad = (t1 - t0) * 0.01 or 1.0
    return t0 - pad, t1 + pad


def step_marks(fig: go.Figure, spans: list[Span]) -> None:
    """A dotted line at the start of every step after the first."""
    starts: dict[int, float] = {}
    for s in spans:
        starts[s.step] = min(starts.get(s.step, s.start_us), s.start_us)
    for step, t in sorted(starts.items())[1:]:
        fig.add_vline(x=t, line={"dash": "dot", "color": "#888", "width": 1},
                      annotation_text=f"step {step}", annotation_position="top left",
                      annotation_font_size=10)


def layout(fig: go.Figure, lanes: Lanes, title: str, height: int) -> None:
    fig.update_layout(
        title={"text": title, "font": {"size": 14}}, height=height, barmode="overlay",
        bargap=0.15, margin={"l": 150, "r": 20, "t": 60, "b": 45}, hovermode="closest",
        dragmode="zoom", legend={"orientation": "v", "groupclick": "togglegroup",
                                 "itemclick": "toggle", "font": {"size": 11}},
        plot_bgcolor="#fbfbfb", uirevision="timeline")
    fig.update_xaxes(title="time (us)", type="linear", showgrid=True, gridcolor="#eee",
                     zeroline=False, tickformat=",.0f")
    fig.update_yaxes(tickvals=list(range(len(lanes.labels))), ticktext=lanes.labels,
                     showgrid=False, zeroline=False, tickfont={"size": 10},
                     range=[len(lanes.labels) - 0.5, -0.5])


def height_for(lanes: int) -> tuple[int, float]:
    """Figure height (px) and the WebGL line width that fills ~70% of a lane."""
    height = int(min(max(140 + 22 * lanes, 320), 2600))
    return height, float(min(max(0.7 * (height - 105) / max(lanes, 1), 2.0), 18.0))


def timeline(trace: Trace, title: str = "", max_spans: int = MAX_SPANS,
             lod: bool | None = None) -> tuple[go.Figure | tuple[go.Figure, str], str]:
    """The timeline figure of one trace (with its level-of-detail script when big), and a
    note when it draws only some steps."""
    spans, note = limit_steps(trace, max_spans)
    if not spans:
        raise ValueError("the trace has no timed spans to draw (only memory events)")
    idle = idle_gaps(spans)
    lanes = Lanes.of([("", spans)])
    height, line_px = height_for(len(lanes.labels))
    fig = go.Figure()
    lane_of = lambda s: lanes.index[(s.rank, s.stream, 0)]  # noqa: E731
    big = len(spans) + len(idle) > GL_SPANS if lod is None else lod
    after = ""
    if big:
        after = add_lod(fig, lod_series(idle + spans, lane_of), len(lanes.labels),
                        x_range(spans), line_px, HOVER)
    else:
        add_bars(fig, idle + spans, lane_of)
    if len(trace.steps()) > 1:
        step_marks(fig, spans)
    layout(fig, lanes, title, height)
    return ((fig, after) if after else fig), note
