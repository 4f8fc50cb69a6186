"""The timeline: lanes, categories, idle gaps (bubbles), level of detail, step limits."""

from __future__ import annotations

import numpy as np

from twin.report import rundir as rd
from twin.report import style
from twin.report.lod import merged
from twin.report.timeline import Lanes, idle_gaps, limit_steps, timed, timeline
from twin.trace import Span, Trace


def test_one_lane_per_rank_and_stream_in_order(runs):
    trace = rd.load(runs["single"]).trace
    spans = timed(trace.spans)
    lanes = Lanes.of([("", spans)])
    assert len(lanes.labels) == len({(s.rank, s.stream) for s in spans})
    assert lanes.labels[0] == "r0 compute" and all("mem" not in label for label in lanes.labels)
    ranks = [int(label.split()[0][1:]) for label in lanes.labels]
    assert ranks == sorted(ranks)


def test_small_trace_draws_every_span_once_as_bars(runs):
    trace = rd.load(runs["pp"]).trace
    fig, _ = timeline(trace)
    spans = timed(trace.spans)
    drawn = sum(len(t.x) for t in fig.data if t.name != "idle")
    assert drawn == len(spans)
    names = {t.name for t in fig.data}
    assert {"forward", "backward", "optimizer", "send", "recv", "idle"} <= names
    assert fig.layout.xaxis.type == "linear"  # microseconds, not dates


def test_idle_gaps_are_the_compute_lane_complement(runs):
    """Per rank and step: compute busy time + idle gaps = the step (no gap dropped here)."""
    spans = timed(rd.load(runs["pp"]).trace.spans)
    gaps = idle_gaps(spans, min_fraction=0.0)
    t0, t1 = min(s.start_us for s in spans), max(s.end_us for s in spans)
    for rank in {s.rank for s in spans}:
        busy = sorted((s.start_us, s.end_us) for s in spans if s.rank == rank and s.stream == "compute")
        covered, end = 0.0, -np.inf
        for a, b in busy:
            covered += max(0.0, b - max(a, end))
            end = max(end, b)
        idle = sum(g.dur_us for g in gaps if g.rank == rank)
        assert abs(covered + idle - (t1 - t0)) <= 1e-6 * (t1 - t0)


def test_pipeline_bubble_is_visible_as_idle(runs):
    """1F1B with pp=2: the last stage waits for the first forward (the warm-up bubble)."""
    spans = timed(rd.load(runs["pp"]).trace.spans)
    gaps = idle_gaps(spans)
    start = min(s.start_us for s in spans)
    assert any(g.rank == 1 and g.start_us == start and g.dur_us > 0 for g in gaps)


def test_big_trace_switches_to_level_of_detail(runs):
    trace = rd.load(runs["single"]).trace
    (fig, after), _ = timeline(trace, lod=True)
    assert "__DIV__-lod" in after and "plotly_relayout" in after
    assert all(t.type == "scatter" and t.mode == "lines" for t in fig.data)
    assert fig.layout.xaxis.autorange is False
    drawn = sum(int(np.nansum(~np.isnan(t.x))) for t in fig.data)
    assert 0 < drawn < 3 * len(timed(trace.spans))  # pre-drawn merged: fewer segments than spans


def test_merging_keeps_touching_spans_as_one_segment_and_gaps_apart():
    spans = [Span(0, 0, "a", "gemm", "compute", 0, 10), Span(0, 0, "b", "gemm", "compute", 10, 20),
             Span(0, 0, "c", "gemm", "compute", 50, 60), Span(1, 0, "d", "gemm", "compute", 0, 5)]
    segs = {(lane, a, b, n) for lane, a, b, n, _ in merged(spans, lambda s: s.rank, tol_us=1.0)}
    assert segs == {(0, 0, 20, 2), (0, 50, 60, 1), (1, 0, 5, 1)}


def test_limit_steps_keeps_whole_steps_and_says_so(runs):
    trace = rd.load(runs["pp"]).trace
    two = Trace(trace.spans + [Span(**{**{f: getattr(s, f) for f in s.__slots__}, "step": 1})
                               for s in trace.spans], trace.meta)
    per_step = len(timed(trace.spans))
    spans, note = limit_steps(two, per_step + 1)
    assert len(spans) == per_step and {s.step for s in spans} == {0}
    assert "showing steps 0..0 of 2" in note and "max_spans" in note
    assert limit_steps(two, 10 * per_step)[1] == ""
    ranks = {s.rank for s in trace.spans}
    spans, note = limit_steps(two, per_step - 1)  # one step is too big: its first ranks
    assert {s.step for s in spans} == {0} and {s.rank for s in spans} == {min(ranks)}
    assert f"showing ranks 0..0 of {len(ranks)} in step 0" in note


def test_colours_distinct_per_category_and_group():
    cats = ["forward", "backward", "recompute", "optimizer", "send", "recv", "idle",
            "all_reduce (tp)", "all_reduce (dp)", "all_reduce (tp-pp-dp)", "all_gather (dp)",
            "all_gather (tp)", "reduce_scatter (dp)", "reduce_scatter (tp)"]
    colours = [style.color(c) for c in cats]
    assert len(set(colours)) == len(cats)
    assert style.color("all_reduce (tp)") == style.color("all_reduce (tp)")
