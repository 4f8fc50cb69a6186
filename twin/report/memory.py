"""Memory over time: live bytes per rank, stacked by category, against the device's memory.

Live memory restarts from zero at every step, as ``twin.metrics.peak_memory`` counts it
(frees before allocs at the same instant), so the peak drawn is the peak summarized.

The trace's alloc/free events hold tensors only. Given the static model's categories per rank
(``static``: ``Memory.as_dict()`` of ``twin.workload.memory.rank_memory``), the figure also
draws what the tensors leave out: the CUDA context, NCCL's buffers and the cuBLAS workspaces
as constant bands under the tensors, and at the peak the largest transient and the caching
allocator's reserve up to the modelled device total; the out-of-memory check uses that total.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from twin.metrics import MEMORY, live_series
from twin.report import style
from twin.trace import Span, Trace

MAX_RANKS = 6
UNDER = ("cuda_context", "comm_buffers", "workspace")
"""Static categories held the whole step, drawn as bands under the live tensors."""
AT_PEAK = ("temporary", "allocator_reserve")
"""Static categories drawn on top of the peak instant."""
COLORS = {**style.MEMORY_COLORS, "cuda_context": "#BAB0AC", "comm_buffers": "#9D755D",
          "workspace": "#FF9DA6", "allocator_reserve": "#72B7B2", "temporary": "#EECA3B"}
MAX_POINTS = 3000
"""Points per rank; denser series keep the highest point of each time bin."""


def thin(times: np.ndarray, values: np.ndarray, max_points: int = MAX_POINTS):
    """Keep the highest total of each of ``max_points`` time bins (peaks survive)."""
    if len(times) <= max_points:
        return times, values
    total = values.sum(axis=1)
    bins = np.minimum(((times - times[0]) / max(times[-1] - times[0], 1e-9) * max_points)
                      .astype(int), max_points - 1)
    keep = {0, len(times) - 1}
    best: dict[int, int] = {}
    for i, b in enumerate(bins):
        if b not in best or total[i] > total[best[b]]:
            best[b] = i
    keep.update(best.values())
    idx = np.array(sorted(keep))
    return times[idx], values[idx]


def pick_ranks(series: dict[int, tuple], max_ranks: int = MAX_RANKS) -> dict[int, list[int]]:
    """Ranks to draw -> the ranks with the same memory curve (copies: DP or TP peers).

    One rank per distinct curve; past ``max_ranks`` curves, those with the highest peaks."""
    groups: dict[tuple, list[int]] = {}
    for r in sorted(series):
        times, cats, values = series[r]
        key = (tuple(cats), round(float(values.sum(axis=1).max()) if len(values) else 0.0, 0),
               len(times))
        groups.setdefault(key, []).append(r)
    reps = {members[0]: members for members in groups.values()}
    if len(reps) > max_ranks:
        top = sorted(reps, key=lambda r: (-max(float(series[r][2].sum(axis=1).max()), 0.0), r))
        reps = {r: reps[r] for r in top[:max_ranks]}
    return dict(sorted(reps.items()))


def with_static(times: np.ndarray, cats: list[str], values: np.ndarray,
                static: dict[str, float] | None) -> tuple[list[str], np.ndarray, float]:
    """The live series with the constant static bands first, and the bytes to add at the peak."""
    if not static:
        return cats, values, 0.0
    under = [c for c in UNDER if static.get(c, 0.0) > 0]
    bands = np.array([[static[c] for c in under]] * len(times)).reshape(len(times), len(under))
    return under + cats, np.hstack([bands, values]), sum(static.get(c, 0.0) for c in AT_PEAK)


def memory_figure(trace: Trace, hbm_bytes: float | None, title: str = "",
                  static: dict[int, dict[str, float]] | None = None) \
        -> tuple[go.Figure | None, str]:
    """Stacked live memory per shown rank, the device's memory as a line, OOM marked.

    ``static``: per rank, the static model's bytes by category (see the module docstring)."""
    by_rank: dict[int, list[Span]] = defaultdict(list)
    for s in trace.spans:
        if s.kind in MEMORY:
            by_rank[s.rank].append(s)
    if not by_rank:
        return None, "the trace has no alloc/free events, so there is no memory to draw"
    series, extra = {}, {}
    for r, ss in by_rank.items():
        times, cats, values = live_series(ss)
        cats, values, extra[r] = with_static(times, cats, values, (static or {}).get(r))
        series[r] = (times, cats, values)
    peaks = {r: (float(v.sum(axis=1).max()) if len(v) else 0.0) + extra[r]
             for r, (_, _, v) in series.items()}
    shown = pick_ranks(series)
    ranks = list(shown)
    covered = sum(len(m) for m in shown.values())
    note = "One panel per distinct memory curve (ranks with the same curve are named in its title)."
    if covered < len(peaks):
        note += f" Showing the {len(ranks)} highest of more curves ({covered} of {len(peaks)} ranks)."

    def same(r: int) -> str:
        rest = shown[r][1:]
        return "" if not rest else f" (same: {_ranks_text(rest)})"

    fig = make_subplots(rows=len(ranks), cols=1, shared_xaxes=True, vertical_spacing=0.08 /
                        max(1, len(ranks) / 3), subplot_titles=[
                            f"rank {r}{same(r)}: peak {peaks[r] / style.GIB:.3g} GiB" for r in ranks])
    seen: set[str] = set()
    ooms = []
    for row, r in enumerate(ranks, start=1):
        times, cats, values = series[r]
        times, values = thin(times, values)
        stack = np.cumsum(values, axis=1)
        if extra[r] and len(times):
            i = int(np.argmax(stack[:, -1]))
            base = float(stack[i, -1])
            fig.add_trace(go.Scatter(
                x=[times[i], times[i]], y=[base / style.GIB, (base + extra[r]) / style.GIB],
                mode="lines+markers", line={"color": COLORS["allocator_reserve"], "width": 4},
                marker={"symbol": "line-ew-open"},
                name="at the peak: transient + allocator reserve", legendgroup="at_peak",
                showlegend="at_peak" not in seen, hovertemplate=(
                    f"modelled at the peak: +{extra[r] / style.GIB:.3g} GiB (largest transient, "
                    f"caching allocator's reserve)<br>device total {peaks[r] / style.GIB:.3g} GiB"
                    "<extra></extra>")), row=row, col=1)
            seen.add("at_peak")
        for j, cat in enumerate(cats):
            fig.add_trace(go.Scatter(
                x=times, y=stack[:, j] / style.GIB, customdata=values[:, j] / style.GIB,
                mode="lines", line={"shape": "hv", "width": 0.8,
                                    "color": COLORS.get(cat, "#999")},
                fill="tozeroy" if j == 0 else "tonexty", name=cat, legendgroup=cat,
                showlegend=cat not in seen,
                hovertemplate=f"{cat}: %{{customdata:.3f}} GiB<br>total below: %{{y:.3f}} GiB"
                              f"<br>t = %{{x:,.1f}} us<extra>rank {r}</extra>"), row=row, col=1)
            seen.add(cat)
        if hbm_bytes:
            off = hbm_bytes > 3 * peaks[r]
            fig.add_trace(go.Scatter(
                x=[times[0], times[-1]], y=[hbm_bytes / style.GIB] * 2, mode="lines",
                line={"color": "#C00", "dash": "dash", "width": 1.5}, legendgroup="device",
                name=f"device memory ({hbm_bytes / style.GIB:.3g} GiB"
                     + (", above the scale)" if off else ")"), showlegend=row == 1,
                hoverinfo="name"), row=row, col=1)
            total = stack[:, -1] if stack.size else np.zeros(0)
            if extra[r] and len(total):
                total = total.copy()
                total[int(np.argmax(total))] += extra[r]
            over = np.nonzero(total > hbm_bytes)[0]
            if len(over):
                i = int(over[0])
                ooms.append(r)
                fig.add_trace(go.Scatter(
                    x=[times[i]], y=[total[i] / style.GIB], mode="markers+text",
                    marker={"symbol": "x", "size": 14, "color": "#C00"}, text=["OOM"],
                    textposition="top right", name="out of memory", legendgroup="oom",
                    showlegend="oom" not in seen, hovertemplate=(
                        f"OOM on rank {r}: {peaks[r] / style.GIB:.3g} GiB needed, "
                        f"{hbm_bytes / style.GIB:.3g} GiB on the device<extra></extra>")),
                    row=row, col=1)
                seen.add("oom")
        top = peaks[r] if not hbm_bytes or hbm_bytes > 3 * peaks[r] else max(peaks[r], hbm_bytes)
        fig.update_yaxes(title_text="GiB", row=row, col=1, range=[0, 1.15 * top / style.GIB])
    fig.update_xaxes(title_text="time (us)", row=len(ranks), col=1, tickformat=",.0f")
    fig.update_layout(title={"text": title, "font": {"size": 14}}, hovermode="closest",
                      height=int(150 + 170 * len(ranks)), margin={"l": 60, "r": 20, "t": 70, "b": 45},
                      plot_bgcolor="#fbfbfb")
    if ooms:
        note = note + " " + \
            f"OUT OF MEMORY on rank{'s' if len(ooms) > 1 else ''} {', '.join(map(str, ooms))}"
    return fig, note


def _ranks_text(ranks: list[int]) -> str:
    """'1, 4-7' style."""
    out, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            out.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ", ".join(out)
