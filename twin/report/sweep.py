"""Sweeps: throughput and scaling efficiency against GPU count, memory per GPU against plan.

Scaling efficiency of N GPUs against the smallest run n0 of the same plan family:
E(N) = (T(N) / N) / (T(n0) / n0), with T tokens per second (1.0: perfectly linear). Each
point also says its speed-up over the previous GPU count ("x1.76 for x2 GPUs"), the number
people quote when doubling GPUs does not double throughput.
"""

from __future__ import annotations

import re
from collections import defaultdict

import plotly.graph_objects as go

from twin.report import style
from twin.report.rundir import Run
from twin.report.summary import plan_label

PALETTE = ("#3366CC", "#DC3912", "#109618", "#990099", "#0099C6", "#DD4477", "#66AA00", "#B82E2E")


def family(run: Run) -> str:
    """A plan without its data-parallel degree: the runs of a GPU sweep share it."""
    if run.job is None:
        return "plan unknown (no config.yaml)"
    label = re.sub(r"\bdp\d+\s*", "", plan_label(run)).strip()
    return f"{run.job.model.name}, {label or 'dp'}"


def scalable(runs: list[Run]) -> list[Run]:
    return [r for r in runs if r.summary and r.world_size and r.summary.get("tokens_per_s")]


def _families(runs: list[Run]) -> dict[str, list[Run]]:
    out: dict[str, list[Run]] = defaultdict(list)
    for r in scalable(runs):
        out[family(r)].append(r)
    return {k: sorted(v, key=lambda r: r.world_size) for k, v in out.items()}


def has_scaling(runs: list[Run]) -> bool:
    """True when some plan family was run at two or more GPU counts."""
    return any(len({r.world_size for r in v}) > 1 for v in _families(runs).values())


def scaling_figures(runs: list[Run]) -> list[go.Figure]:
    """Tokens/s against GPUs (with the linear ideal), and efficiency with each step's speed-up."""
    fams = {k: v for k, v in _families(runs).items() if len({r.world_size for r in v}) > 1}
    thr, eff = go.Figure(), go.Figure()
    sizes: set[int] = set()
    for i, (fam, rs) in enumerate(sorted(fams.items())):
        c = PALETTE[i % len(PALETTE)]
        n = [r.world_size for r in rs]
        t = [r.summary["tokens_per_s"] for r in rs]
        sizes.update(n)
        names = [r.name for r in rs]
        thr.add_trace(go.Scatter(x=n, y=t, mode="lines+markers", name=fam, line={"color": c},
                                 customdata=names, hovertemplate="%{x} GPUs: %{y:,.0f} tokens/s"
                                 "<extra>%{customdata}</extra>"))
        thr.add_trace(go.Scatter(x=n, y=[t[0] * k / n[0] for k in n], mode="lines",
                                 name=f"{fam}: linear", line={"color": c, "dash": "dot", "width": 1},
                                 hoverinfo="skip"))
        e = [(tk / k) / (t[0] / n[0]) for tk, k in zip(t, n)]
        labels = ["baseline"] + [f"x{t[j] / t[j - 1]:.2f} for x{n[j] / n[j - 1]:.3g} GPUs"
                                 for j in range(1, len(n))]
        eff.add_trace(go.Scatter(x=n, y=[100 * v for v in e], mode="lines+markers+text", name=fam,
                                 line={"color": c}, text=labels, textposition="bottom center",
                                 textfont={"size": 11}, customdata=names,
                                 hovertemplate="%{x} GPUs: %{y:.1f} % (%{text})<extra>%{customdata}"
                                               "</extra>"))
    ticks = sorted(sizes)
    axis = {"type": "log", "tickvals": ticks, "ticktext": [str(k) for k in ticks],
            "title": "GPUs"}
    thr.update_layout(title={"text": "throughput against GPU count (dotted: linear scaling)",
                             "font": {"size": 14}}, xaxis=axis, yaxis={"title": "tokens/s",
                             "rangemode": "tozero"}, height=420, plot_bgcolor="#fbfbfb",
                      margin={"l": 70, "r": 20, "t": 50, "b": 50})
    eff.add_hline(y=100, line={"color": "#888", "dash": "dot", "width": 1})
    eff.update_layout(title={"text": "scaling efficiency: (tokens/s per GPU) / (the same at the "
                             "smallest GPU count)", "font": {"size": 14}}, xaxis=axis,
                      yaxis={"title": "efficiency (%)", "range": [0, 115]}, height=420,
                      plot_bgcolor="#fbfbfb", margin={"l": 70, "r": 20, "t": 50, "b": 50})
    return [thr, eff]


def plan_figures(runs: list[Run]) -> list[go.Figure]:
    """Peak memory per GPU and tokens/s per GPU for each run, labelled by plan and GPU count."""
    rs = [r for r in runs if r.summary]
    labels = [f"{plan_label(r)}<br>{r.world_size or '?'} GPUs · {r.name}" for r in rs]
    peaks = [r.summary.get("peak_memory_max_bytes", 0.0) / style.GIB for r in rs]
    fits = [r.summary.get("fits_memory", True) for r in rs]
    mem = go.Figure(go.Bar(x=labels, y=peaks, marker_color=["#4C78A8" if f else "#C00" for f in fits],
                           name="peak memory per GPU", hovertemplate="%{y:.3g} GiB<extra></extra>"))
    hbm = {r.hbm_bytes for r in rs if r.hbm_bytes}
    for h in sorted(hbm):
        mem.add_trace(go.Scatter(x=[labels[0], labels[-1]], y=[h / style.GIB] * 2, mode="lines",
                                 line={"color": "#C00", "dash": "dash"},
                                 name=f"device memory {h / style.GIB:.3g} GiB"))
    mem.update_layout(title={"text": "peak memory per GPU by plan (red: does not fit)",
                             "font": {"size": 14}}, yaxis_title="GiB", height=420,
                      plot_bgcolor="#fbfbfb", margin={"l": 60, "r": 20, "t": 50, "b": 90})
    per_gpu = [r.summary.get("tokens_per_s", 0.0) / (r.world_size or 1) for r in rs]
    thr = go.Figure(go.Bar(x=labels, y=per_gpu, marker_color="#109618", name="tokens/s per GPU",
                           customdata=[100 * r.summary.get("mfu", 0.0) for r in rs],
                           hovertemplate="%{y:,.0f} tokens/s per GPU, MFU %{customdata:.1f} %"
                                         "<extra></extra>"))
    thr.update_layout(title={"text": "throughput per GPU by plan", "font": {"size": 14}},
                      yaxis_title="tokens/s per GPU", height=380, plot_bgcolor="#fbfbfb",
                      margin={"l": 70, "r": 20, "t": 50, "b": 90})
    return [mem, thr]
