"""validate's figures per source (replay, pytorch) and their table, on fabricated rows (no process)."""

from __future__ import annotations

import json

import pytest
from omegaconf import OmegaConf

from paratwin.verbs.validate import format_result, format_table, run_one
from twin.trace import Span, Trace
from twin.validate import profile_kind_errors, source_rows, suite_figures


def fig(p50: float, pred: float, lo: float | None = None, hi: float | None = None) -> dict:
    lo, hi = lo if lo is not None else p50 * 0.9, hi if hi is not None else p50 * 1.1
    return {"measured_p50_s": p50, "measured_p10_s": lo, "measured_p90_s": hi, "predicted_s": pred,
            "error": pred / p50 - 1, "in_band": lo <= pred <= hi, "kinds": {}, "profile": "p",
            "wall_s": 1.0}


def row(name: str, **sources) -> dict:
    first = next(iter(sources.values()))
    return {"name": name, "parallel": name.split("-")[0], "world_size": 2, "sources": sources,
            "against": list(sources), **({k: first[k] for k in first} if "error" in first else {})}


ROWS = [row("ddp-w2", replay=fig(0.10, 0.105), pytorch=fig(0.20, 0.105)),
        row("fsdp-w2", replay=fig(0.20, 0.16), pytorch=fig(0.40, 0.16)),
        row("zero1-w2", replay=fig(0.10, 0.10), pytorch={"skipped": "no counterpart"})]


def test_suite_figures_per_source():
    rep, pt = suite_figures(ROWS, "replay"), suite_figures(ROWS, "pytorch")
    assert rep["runs"] == 3 and rep["in_band"] == 2 and rep["worst"] == "fsdp-w2"
    assert rep["max_abs_error"] == pytest.approx(0.2) and rep["median_abs_error"] == pytest.approx(0.05)
    assert pt["runs"] == 2 and pt["in_band"] == 0 and pt["worst"] == "fsdp-w2"
    assert pt["median_abs_error"] == pytest.approx((0.475 + 0.6) / 2)
    assert suite_figures(ROWS) == rep  # the top level is each row's first source
    old = [{k: v for k, v in ROWS[0].items() if k not in ("sources", "against")}]
    assert suite_figures(old, "replay")["runs"] == 1  # rows written before sources: replay rows
    assert [r["name"] for r in source_rows(ROWS, "pytorch")] == ["ddp-w2", "fsdp-w2"]


def test_profile_kinds_against_the_twin_spans():
    spans = [Span(0, 0, "a", "gemm", "compute", 0, 3000), Span(1, 0, "a", "gemm", "compute", 0, 1000),
             Span(0, 0, "o", "optimizer", "compute", 0, 500), Span(0, 0, "r", "all_reduce", "comm", 0, 200),
             Span(0, 0, "s", "send", "p2p", 0, 100), Span(0, 1, "a", "gemm", "compute", 0, 9e9)]
    got = profile_kind_errors({"gemm": 0.008, "optimizer": 0.001, "attention": 0.0,
                               "collectives": 0.001, "framework": 0.002, "unattributed": 0.003},
                              Trace(spans))
    assert got["gemm"]["predicted_s"] == pytest.approx(0.004) and got["gemm"]["error"] == pytest.approx(-0.5)
    assert got["optimizer"]["error"] == pytest.approx(-0.5)
    assert got["attention"]["error"] is None  # nothing measured
    assert got["collectives"]["predicted_s"] == pytest.approx(0.0003) and got["collectives"]["error"] is None
    assert got["framework"]["predicted_s"] is None and got["unattributed"]["error"] is None
    assert got["_source"]["source"] == "torch.profiler"
    # the compute kinds at the cost model's time (a fit's prediction), the rest from the spans
    got = profile_kind_errors({"gemm": 0.008, "optimizer": 0.001, "collectives": 0.001},
                              Trace(spans), {"gemm": 0.002, "optimizer": 0.002})
    assert got["gemm"]["predicted_s"] == 0.002 and got["gemm"]["error"] == pytest.approx(-0.75)
    assert got["optimizer"]["error"] == pytest.approx(1.0)
    assert got["collectives"]["predicted_s"] == pytest.approx(0.0003)


def _result(against: str, rows: list[dict]) -> dict:
    srcs = {"replay": ("replay",), "pytorch": ("pytorch",), "both": ("replay", "pytorch")}[against]
    skipped = [{"name": r["name"], "source": s, "reason": r["sources"][s]["skipped"]}
               for r in rows for s in srcs if "skipped" in r["sources"].get(s, {})]
    return {"against": against, "figures": suite_figures(rows),
            "sources": {s: suite_figures(rows, s) for s in srcs}, "runs": rows,
            "information": [], "skipped": skipped, "out_dir": "x"}


def test_table_has_a_section_per_source_and_the_skipped():
    text = format_result(_result("both", ROWS))
    assert "against the replay" in text and "against PyTorch" in text
    assert "3 runs at world size 2" in text and "2 runs at world size 2" in text
    assert "zero1-w2 (pytorch): no counterpart" in text
    side = next(line for line in text.splitlines() if line.startswith("ddp-w2") and "+" not in line[:60]
                and len(line.split()) == 5)
    assert side.split()[1:4] == ["105.0", "100.0", "200.0"]  # twin, replay, PyTorch ms
    only = [{k: v for k, v in r.items()} for r in ROWS]
    assert format_result(_result("replay", only)) == format_table(only, [], suite_figures(only))


def test_resume_keeps_a_finished_run_and_reads_rows_written_before_sources(tmp_path):
    (tmp_path / "ddp-w2").mkdir()
    old = {k: v for k, v in ROWS[0].items() if k not in ("sources", "against")}
    (tmp_path / "ddp-w2" / "result.json").write_text(json.dumps(old))
    cfg = OmegaConf.create({"resume": True})
    got = run_one("ddp-w2", "ddp", 2, cfg, tmp_path, ("tiny", "cpu_local", []), ("replay",))
    assert got["against"] == ["replay"] and got["sources"]["replay"]["error"] == old["error"]
    assert got["wall_s"] == old["wall_s"] and got["measured_p50_s"] == old["measured_p50_s"]


def _summary(p10: float, p50: float, p90: float) -> dict:
    return {"step_time_s": p50, "step_time_p10_s": p10, "step_time_p90_s": p90}


def test_steadiest_measures_again_while_the_band_is_wide(tmp_path):
    """Spreads 0.5, 0.3, 0.1 under max_spread 0.2: three measurements, the third kept; each
    into its own directory; a first narrow one is measured once; without max_spread, once."""
    from twin.validate import spread, steadiest

    seen = []
    bands = iter([_summary(0.8, 1.0, 1.3), _summary(0.9, 1.0, 1.2), _summary(0.95, 1.0, 1.05)])

    def measure(where):
        seen.append(where)
        return next(bands)

    where, summary, attempts = steadiest(measure, tmp_path / "pytorch", 0.2, 3)
    assert seen == [tmp_path / "pytorch", tmp_path / "pytorch.retry1", tmp_path / "pytorch.retry2"]
    assert where == seen[-1] and spread(summary) == pytest.approx(0.1)
    assert [round(a["spread"], 6) for a in attempts] == [0.5, 0.3, 0.1]
    # retries run out: the narrowest of those measured
    wide = iter([_summary(0.7, 1.0, 1.3), _summary(0.8, 1.0, 1.2), _summary(0.5, 1.0, 1.5)])
    where, summary, attempts = steadiest(lambda _w: next(wide), tmp_path / "x", 0.1, 2)
    assert where.name == "x.retry1" and len(attempts) == 3 and spread(summary) == pytest.approx(0.4)
    for limit in (0.6, None):
        once = iter([_summary(0.8, 1.0, 1.3)])
        assert len(steadiest(lambda _w, it=once: next(it), tmp_path / "y", limit, 5)[2]) == 1
