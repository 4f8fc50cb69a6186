"""The mixture-of-experts section: each layer's expert loads and the all-to-all it leaves exposed.

Loads come from the job's routing model (twin/workload/moe.py: the same tokens per expert the
schedule's grouped GEMMs and uneven all-to-alls use), as load over the mean (1: balanced).
The exposed all-to-all of a layer is the time its expert-parallel collectives (groups ep and
edp) run on a rank while no compute does, in the trace's first step, as a mean over the ranks
the trace holds.
"""

from __future__ import annotations

import numpy as np
import plotly.graph_objects as go

from twin.metrics import exposed_length
from twin.spec import Job
from twin.trace import Trace
from twin.vocab import COMPUTE_KINDS
from twin.workload.moe import tokens_per_expert

EXPERT_GROUPS = ("ep", "edp")
"""Group names of the expert-parallel collectives (dispatch/combine, expert gradients)."""


def expert_loads(job: Job) -> tuple[list[int], np.ndarray]:
    """(MoE layers, load per layer and expert over the mean) of the job's routing model."""
    moe = job.model.moe
    layers = list(moe.moe_layers(job.model.num_layers))
    tokens = job.parallel.micro_batch_size * job.model.seq_len
    loads = np.array([tokens_per_expert(moe, layer, tokens) for layer in layers], dtype=float)
    mean = loads.mean(axis=1, keepdims=True)
    return layers, np.divide(loads, mean, out=np.ones_like(loads), where=mean > 0)


def exposed_a2a_per_layer(trace: Trace) -> dict[int, float]:
    """Layer -> seconds of expert-parallel communication not hidden behind compute, in the
    trace's first step, averaged over its ranks."""
    steps = trace.steps()
    if not steps:
        return {}
    spans = [s for s in trace.spans if s.step == steps[0]]
    ranks = sorted({s.rank for s in spans})
    out: dict[int, float] = {}
    for rank in ranks:
        mine = [s for s in spans if s.rank == rank]
        compute = [(s.start_us, s.end_us) for s in mine if s.kind in COMPUTE_KINDS]
        by_layer: dict[int, list[tuple[float, float]]] = {}
        for s in mine:
            if s.group in EXPERT_GROUPS and s.layer >= 0:
                by_layer.setdefault(s.layer, []).append((s.start_us, s.end_us))
        for layer, comm in by_layer.items():
            out[layer] = out.get(layer, 0.0) + exposed_length(comm, compute) / 1e6 / len(ranks)
    return dict(sorted(out.items()))


def _layout(fig: go.Figure, title: str, **kw) -> go.Figure:
    fig.update_layout(title={"text": title, "font": {"size": 14}}, plot_bgcolor="#fbfbfb",
                      margin={"l": 60, "r": 20, "t": 50, "b": 45}, height=360, **kw)
    return fig


def loads_figure(job: Job, title: str) -> go.Figure:
    layers, loads = expert_loads(job)
    fig = go.Figure(go.Heatmap(z=loads, x=list(range(loads.shape[1])), y=layers,
                               colorscale="RdBu_r", zmid=1.0, colorbar={"title": "load / mean"},
                               hovertemplate="layer %{y}, expert %{x}: %{z:.2f} x mean"
                                             "<extra></extra>"))
    return _layout(fig, title, xaxis_title="expert", yaxis_title="layer")


def exposed_figure(per_layer: dict[int, float], title: str) -> go.Figure:
    fig = go.Figure(go.Bar(x=list(per_layer), y=[v * 1e3 for v in per_layer.values()],
                           hovertemplate="layer %{x}: %{y:.2f} ms<extra></extra>"))
    return _layout(fig, title, xaxis_title="layer", yaxis_title="exposed all-to-all (ms)")


def moe_figures(job: Job, trace: Trace | None, name: str) -> tuple[list[go.Figure], str]:
    """The section's figures for one run and its note."""
    moe = job.model.moe
    routing = "uniform routing" if moe.routing == "uniform" else \
        f"{moe.routing} routing (skew {moe.routing_skew}, seed {moe.routing_seed})"
    figs = [loads_figure(job, f"expert load per layer: {name} ({routing})")]
    note = (f"Tokens each expert receives per micro-batch under the {routing} model, over the "
            "mean (red: hot experts, whose ranks every all-to-all waits for).")
    per_layer = exposed_a2a_per_layer(trace) if trace is not None else {}
    if per_layer:
        figs.append(exposed_figure(per_layer, f"exposed all-to-all per layer: {name}"))
        note += (" Below: per layer, the expert-parallel communication (ep, edp) no compute "
                 "hides, first step, mean over the traced ranks.")
    return figs, note
