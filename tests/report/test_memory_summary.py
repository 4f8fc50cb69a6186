"""Memory over time (peaks as summarized, OOM marked) and the summary's numbers."""

from __future__ import annotations

import pytest

from twin.metrics import MEMORY, live_series, peak_memory
from twin.report import rundir as rd
from twin.report import summary
from twin.report.memory import memory_figure, pick_ranks


def test_live_series_peak_is_the_summarized_peak(runs):
    run = rd.load(runs["single"])
    for rank in range(8):
        spans = [s for s in run.trace.spans if s.rank == rank and s.kind in MEMORY]
        _, cats, values = live_series(spans)
        assert values.sum(axis=1).max() == pytest.approx(peak_memory(spans))
        assert {"params", "activations"} <= set(cats)


def test_copies_share_a_panel(runs):
    run = rd.load(runs["single"])
    by_rank = {r: live_series([s for s in run.trace.spans if s.rank == r and s.kind in MEMORY])
               for r in range(8)}
    shown = pick_ranks(by_rank)
    assert sorted(r for members in shown.values() for r in members) == list(range(8))
    assert len(shown) < 8  # DP and TP peers have the same curve


def test_oom_is_marked_and_named(runs):
    run = rd.load(runs["oom"])
    assert run.summary["fits_memory"] is False
    fig, note = memory_figure(run.trace, run.hbm_bytes)
    assert "OUT OF MEMORY" in note
    assert any(t.name == "out of memory" for t in fig.data)
    assert any(t.name.startswith("device memory") for t in fig.data)


def test_fitting_run_has_no_oom_marker(runs):
    run = rd.load(runs["single"])
    fig, note = memory_figure(run.trace, run.hbm_bytes)
    assert "OUT OF MEMORY" not in note and not any(t.name == "out of memory" for t in fig.data)


def test_summary_table_quotes_the_numbers(runs):
    run = rd.load(runs["single"])
    html = summary.summary_table([run])
    for label in ("step time", "tokens/s", "TFLOP/s per GPU", "MFU", "pipeline bubble",
                  "exposed comm (tp)", "exposed comm (dp)", "peak memory"):
        assert label in html
    assert f"{run.summary['tokens_per_s']:,.0f}" in html
    assert summary.plan_label(run) == "dp2 tp2 pp2 zero1 sp 1f1b"


def test_critical_path_bars_add_up_to_the_summary(runs):
    run = rd.load(runs["pp"])
    parts = run.summary["critical_path_s"]
    assert parts and sum(parts.values()) == pytest.approx(run.summary["step_time_s"], rel=2e-3)
    fig = summary.critical_path_figure([run])
    assert {t.name for t in fig.data} == set(parts) and fig.layout.barmode == "stack"
    assert sum(t.x[0] for t in fig.data) == pytest.approx(sum(parts.values()) * 1e3)
