"""The search report: the Pareto front of throughput against GPUs and memory per GPU, each
simulated plan linked to its run directory.

It draws what `paratwin search` hands it (its search.json result and the estimate's cloud
of plans as plain tuples); it computes nothing and runs no simulation. A plan is on the
front when no other plan has more tokens/s with no more GPUs and no more memory.
"""

from __future__ import annotations

import html as _html
import os
from collections import defaultdict
from pathlib import Path

import plotly.graph_objects as go

from twin.report import html, style
from twin.report.sweep import PALETTE

CLICK = """<script>
(function () {
  const gd = document.getElementById('__DIV__');
  gd.on('plotly_click', ev => {
    const p = ev.points && ev.points[0];
    const url = p && p.customdata && p.customdata[0];
    if (url) window.open(url, '_blank');
  });
})();
</script>"""


def _link(run_dir: str | None, page: Path) -> str:
    """A relative link from the report to a run's report.html (or its directory)."""
    if not run_dir:
        return ""
    target = Path(run_dir) / "report.html"
    if not target.exists():
        target = Path(run_dir)
    try:
        return os.path.relpath(target, page.parent)
    except ValueError:
        return str(target)


def _front_line(points: list[tuple[float, float]]) -> tuple[list[float], list[float]]:
    """The staircase of the best tokens/s at each memory (x ascending)."""
    xs, ys, best = [], [], float("-inf")
    for x, y in sorted(points):
        if y > best:
            xs.append(x)
            ys.append(y)
            best = y
    return xs, ys


def pareto_figure(result: dict, cloud: list[tuple[float, int, float, str]],
                  page: Path) -> go.Figure:
    """Tokens/s against peak memory per GPU: the estimate's cloud (one colour per GPU
    count), its front, and the simulated plans (click one to open its run)."""
    fig = go.Figure()
    counts = sorted({g for _, g, _, _ in cloud} | {row["gpus"] for row in result["plans"]})
    colour = {g: PALETTE[k % len(PALETTE)] for k, g in enumerate(counts)}
    by_gpus: dict[int, list] = defaultdict(list)
    for pt in cloud:
        by_gpus[pt[1]].append(pt)
    for g in counts:
        pts = by_gpus.get(g, [])
        if not pts:
            continue
        fig.add_trace(go.Scattergl(
            x=[p[2] / style.GIB for p in pts], y=[p[0] for p in pts], mode="markers",
            name=f"{g} GPUs (estimate)", marker={"color": colour[g], "size": 4, "opacity": 0.35},
            text=[p[3] for p in pts],
            hovertemplate="%{text}<br>%{y:,.0f} tokens/s (estimate), %{x:.1f} GiB<extra></extra>"))
        xs, ys = _front_line([(p[2] / style.GIB, p[0]) for p in pts])
        fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines", line={"color": colour[g], "width": 1,
                                                                 "shape": "hv", "dash": "dot"},
                                 name=f"{g} GPUs: front (estimate)", hoverinfo="skip"))
    sim = [r for r in result["plans"] if r.get("source") == "twin"]
    if sim:
        fig.add_trace(go.Scatter(
            x=[r["peak_memory_bytes"] / style.GIB for r in sim],
            y=[r["tokens_per_s"] for r in sim], mode="markers",
            name="simulated (click: its run)",
            marker={"size": [14 if r.get("pareto") else 9 for r in sim],
                    "color": [colour.get(r["gpus"], "#333") for r in sim],
                    "symbol": ["star" if r.get("pareto") else "circle" for r in sim],
                    "line": {"color": "#111", "width": 1}},
            customdata=[[_link(r.get("run_dir"), page), r["label"], r["gpus"],
                         100 * r["mfu"], r["estimate"]["step_time_s"], r["step_time_s"]]
                        for r in sim],
            hovertemplate="%{customdata[1]} on %{customdata[2]} GPUs<br>%{y:,.0f} tokens/s, "
                          "MFU %{customdata[3]:.1f} %, %{x:.1f} GiB<br>step %{customdata[5]:.3f} s "
                          "(estimate %{customdata[4]:.3f} s)<extra>twin</extra>"))
    hbm = result.get("hbm_bytes")
    if hbm:
        fig.add_vline(x=hbm / style.GIB, line={"color": "#C00", "dash": "dash", "width": 1},
                      annotation_text="HBM", annotation_position="top left")
    fig.update_layout(title={"text": "throughput against peak memory per GPU (stars: simulated "
                             "plans on the Pareto front)", "font": {"size": 14}},
                      xaxis={"title": "peak memory per GPU (GiB)"},
                      yaxis={"title": "tokens/s", "rangemode": "tozero"}, height=520,
                      plot_bgcolor="#fbfbfb", margin={"l": 70, "r": 20, "t": 50, "b": 50})
    return fig


def gpus_figure(result: dict, cloud: list[tuple[float, int, float, str]]) -> go.Figure | None:
    """The best tokens/s at each GPU count (estimate, and the twin where simulated)."""
    best: dict[int, float] = {}
    for tok, g, _, _ in cloud:
        best[g] = max(best.get(g, 0.0), tok)
    if len(best) < 2:
        return None
    sim: dict[int, float] = {}
    for r in result["plans"]:
        if r.get("source") == "twin":
            sim[r["gpus"]] = max(sim.get(r["gpus"], 0.0), r["tokens_per_s"])
    fig = go.Figure()
    gs = sorted(best)
    fig.add_trace(go.Scatter(x=gs, y=[best[g] for g in gs], mode="lines+markers",
                             name="best plan (estimate)"))
    if sim:
        ss = sorted(sim)
        fig.add_trace(go.Scatter(x=ss, y=[sim[g] for g in ss], mode="markers",
                                 marker={"size": 11, "symbol": "star"}, name="best simulated"))
    fig.update_layout(title={"text": "best throughput at each GPU count", "font": {"size": 14}},
                      xaxis={"title": "GPUs", "type": "log", "tickvals": gs,
                             "ticktext": [str(g) for g in gs]},
                      yaxis={"title": "tokens/s", "rangemode": "tozero"}, height=420,
                      plot_bgcolor="#fbfbfb", margin={"l": 70, "r": 20, "t": 50, "b": 50})
    return fig


def _table(result: dict, page: Path) -> str:
    rows = []
    for k, r in enumerate(result["plans"], start=1):
        link = _link(r.get("run_dir"), page)
        name = f"<a href='{_html.escape(link)}'>{_html.escape(r['label'])}</a>" if link \
            else _html.escape(r["label"])
        rows.append(f"<tr><td>{k}</td><td>{r['gpus']}</td><td style='text-align:left'>{name}"
                    f"{' *' if r.get('pareto') else ''}</td><td>{r['step_time_s']:.4g}</td>"
                    f"<td>{r['tokens_per_s']:,.0f}</td><td>{100 * r['mfu']:.1f} %</td>"
                    f"<td>{r['peak_memory_bytes'] / style.GIB:.3g}</td>"
                    f"<td>{100 * r['bubble_fraction']:.1f} %</td>"
                    f"<td>{r['estimate']['step_time_s']:.4g}</td></tr>")
    head = "".join(f"<th>{h}</th>" for h in ("#", "GPUs", "plan (* on the front)", "step s",
                                             "tokens/s", "MFU", "peak GiB", "bubble", "estimate s"))
    return f"<table class='kv'><tr>{head}</tr>{''.join(rows)}</table>"


def write_search_report(path: str | Path, result: dict,
                        cloud: list[tuple[float, int, float, str]]) -> Path:
    """The report page of a search (see the module docstring)."""
    page = Path(path)
    a = result.get("agreement") or {}
    note = (f"{result['evaluated']:,} plans evaluated, {result['fit']:,} fit in memory, "
            f"{result['simulated']} simulated with the full twin (profile {result['profile']}).")
    if a.get("plans", 0) > 1:
        note += (f" Estimate vs twin on them: Spearman {a['spearman']:.2f}, median error "
                 f"{100 * a['median_abs_error']:.1f} %." if a.get("spearman") is not None else "")
    figs: list = [(pareto_figure(result, cloud, page), CLICK)]
    extra = gpus_figure(result, cloud)
    if extra is not None:
        figs.append(extra)
    sections = [html.Section("front", "Pareto front", note, figs),
                html.Section("plans", "Ranked plans", "Simulated plans by the twin's step time "
                             "(each links to its run's report).", [], _table(result, page))]
    gpus = "/".join(map(str, result["gpus"]))
    return html.write(page, f"paratwin search: {result['model']} on {result['cluster']}",
                      f"{gpus} GPUs, global batch {result['global_batch_size']} sequences",
                      sections)
