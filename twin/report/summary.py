"""The numbers users quote, per run: a table, and where a step's time goes as bars."""

from __future__ import annotations

import statistics

import plotly.graph_objects as go

from twin.report import style
from twin.report.html import kv_table
from twin.report.rundir import Run


def plan_label(run: Run) -> str:
    """Short description of a run's plan: 'dp4 tp2 pp2 zero1 1f1b' (degrees > 1 only)."""
    if run.job is None:
        return run.name
    p = run.job.parallel
    parts = [f"{k}{getattr(p, k)}" for k in ("dp", "tp", "pp") if getattr(p, k) > 1] or ["single"]
    if p.zero_stage:
        parts.append("fsdp" if p.zero_stage == 3 else f"zero{p.zero_stage}")
    if p.sp:
        parts.append("sp")
    if p.pp > 1:
        parts.append(p.pp_schedule + (f" v{p.pp_virtual_stages}" if p.pp_virtual_stages > 1 else ""))
    if p.recompute != "none":
        parts.append(f"recompute={p.recompute}")
    return " ".join(parts)


def run_label(run: Run) -> str:
    """'NAME (source, model on cluster, N GPUs)' for headings and legends."""
    bits = [run.source]
    if run.job is not None:
        bits.append(f"{run.job.model.name} on {run.job.cluster.name}, {plan_label(run)}")
    if run.world_size:
        bits.append(f"{run.world_size} GPUs")
    return f"{run.name} ({', '.join(bits)})"


def _fmt_rows(s: dict, hbm: float | None) -> list[tuple[str, str]]:
    rows = [("step time", style.duration(s["step_time_s"]) + (
        f" (p10 {style.duration(s['step_time_p10_s'])}, p90 {style.duration(s['step_time_p90_s'])},"
        f" {s.get('steps', 1)} steps)" if s.get("steps", 1) > 1 and "step_time_p10_s" in s else "")),
        ("tokens/s", f"{s['tokens_per_s']:,.0f}" if "tokens_per_s" in s else "-"),
        ("TFLOP/s per GPU", f"{s['tflops_per_gpu']:.4g}" if "tflops_per_gpu" in s else "-"),
        ("MFU", f"{100 * s['mfu']:.2f} %" if "mfu" in s else "-"),
        ("pipeline bubble", f"{100 * s.get('bubble_fraction', 0.0):.1f} % of the step")]
    for g, v in sorted((s.get("exposed_comm_s") or {}).items()):
        share = f" ({100 * v / s['step_time_s']:.1f} %)" if s.get("step_time_s") else ""
        rows.append((f"exposed comm ({g})", style.duration(v) + share))
    peak = s.get("peak_memory_max_bytes")
    if peak is not None:
        dev = f" of {hbm / style.GIB:.3g} GiB" if hbm else ""
        fits = "" if s.get("fits_memory", True) else " - DOES NOT FIT"
        rows.append(("peak memory (max rank)", f"{peak / style.GIB:.3g} GiB{dev}{fits}"))
    if s.get("world_size"):
        rows.append(("GPUs", str(s["world_size"])))
    return rows


def summary_table(runs: list[Run]) -> str:
    """One column per run; rows are the quoted numbers (missing ones show '-')."""
    cols = [dict(_fmt_rows(r.summary, r.hbm_bytes)) for r in runs if r.summary]
    named = [r for r in runs if r.summary]
    keys: list[str] = []
    for c in cols:
        keys += [k for k in c if k not in keys]
    rows = [[k, *(c.get(k, "-") for c in cols)] for k in keys]
    return kv_table(rows, ["", *(r.name for r in named)])


def breakdown_figure(runs: list[Run]) -> go.Figure | None:
    """Where the median step goes (mean over ranks): compute, bubble, exposed comm per group."""
    named = [r for r in runs if r.summary and "compute_s" in r.summary]
    if not named:
        return None
    parts: dict[str, list[float]] = {"step": [], "compute": [], "pipeline bubble": []}
    groups = sorted({g for r in named for g in (r.summary.get("exposed_comm_s") or {})})
    for g in groups:
        parts[f"exposed comm ({g})"] = []
    for r in named:
        s = r.summary
        parts["step"].append(s["step_time_s"])
        parts["compute"].append(statistics.mean(s["compute_s"].values()) if s["compute_s"] else 0.0)
        parts["pipeline bubble"].append(s.get("bubble_fraction", 0.0) * s["step_time_s"])
        for g in groups:
            parts[f"exposed comm ({g})"].append((s.get("exposed_comm_s") or {}).get(g, 0.0))
    colours = {"step": "#444", "compute": style.FIXED["forward"], "pipeline bubble": "#BBBBBB"}
    fig = go.Figure()
    names = [r.name for r in named]
    for k, vals in parts.items():
        fig.add_trace(go.Bar(
            y=names, x=[v * 1e3 for v in vals], name=k, orientation="h",
            marker_color=colours.get(k, style.color(f"all_reduce ({k[14:-1]})")),
            hovertemplate=f"{k}: %{{x:.4g}} ms<extra>%{{y}}</extra>"))
    fig.update_layout(barmode="group", title={"text": "where the step goes (mean over ranks; "
                      "exposed comm and bubble overlap idle time)", "font": {"size": 14}},
                      xaxis_title="ms", height=int(200 + 28 * len(parts) * len(named) ** 0.8),
                      margin={"l": 120, "r": 20, "t": 50, "b": 45}, yaxis={"autorange": "reversed"},
                      plot_bgcolor="#fbfbfb")
    return fig


CRITICAL_COLOURS = {"gemm": "#3366CC", "attention": "#0099C6", "elementwise": "#66AA00",
                    "optimizer": "#990099", "host": "#DC3912", "collectives": "#FF9900",
                    "p2p": "#B82E2E", "overlap": "#AAAA11", "other": "#BBBBBB"}


def critical_path_figure(runs: list[Run]) -> go.Figure | None:
    """What each twin run's critical path spends its time on (summary.json's
    critical_path_s): stacked bars, one per run, one colour per mechanism."""
    named = [r for r in runs if r.summary and r.summary.get("critical_path_s")]
    if not named:
        return None
    keys: list[str] = []
    for r in named:
        keys += [k for k in r.summary["critical_path_s"] if k not in keys]
    keys.sort(key=lambda k: list(CRITICAL_COLOURS).index(k) if k in CRITICAL_COLOURS else 99)
    fig = go.Figure()
    names = [r.name for r in named]
    for k in keys:
        vals = [r.summary["critical_path_s"].get(k, 0.0) * 1e3 for r in named]
        fig.add_trace(go.Bar(y=names, x=vals, name=k, orientation="h",
                             marker_color=CRITICAL_COLOURS.get(k, "#888"),
                             hovertemplate=f"{k}: %{{x:.4g}} ms<extra>%{{y}}</extra>"))
    fig.update_layout(barmode="stack", title={"text": "the step's critical path by mechanism "
                      "(compute per kind, the host issuing ops, collectives, send/recv)",
                      "font": {"size": 14}}, xaxis_title="ms",
                      height=int(160 + 40 * len(named)), yaxis={"autorange": "reversed"},
                      margin={"l": 120, "r": 20, "t": 50, "b": 45}, plot_bgcolor="#fbfbfb")
    return fig
