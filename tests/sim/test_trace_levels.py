"""The trace a run keeps is sized to its use (twin/sim/spans.py): the report's default level
of detail unless every rank's spans are asked for, written a chunk at a time; the summary
covers every simulated rank whatever the trace holds."""

from __future__ import annotations

import json

import pytest

from tests.cli.test_inspect_cli import paratwin
from tests.conftest import cluster, gpt
from twin.report.timeline import MAX_SPANS
from twin.sim import spans as spans_mod
from twin.sim.engine import SimOptions
from twin.sim.run import simulate
from twin.sim.spans import TRACE_SPANS, recorded_ranks
from twin.spec import ParallelPlan, build_job
from twin.trace import Trace


def _job():
    return build_job(gpt(), cluster(gpus=8), ParallelPlan(pp=4, global_batch_size=16))


def test_auto_holds_what_the_report_draws():
    assert TRACE_SPANS == MAX_SPANS


def test_auto_records_each_stage_first_then_the_rest_within_the_budget(monkeypatch):
    stage_of = {0: 0, 1: 0, 2: 1, 3: 1}
    timed = dict.fromkeys(stage_of, 100)
    monkeypatch.setattr(spans_mod, "TRACE_SPANS", 250)
    assert recorded_ranks("auto", stage_of, timed, steps=1) == [0, 2]
    assert recorded_ranks("auto", stage_of, timed, steps=3) == [0]  # one rank at least
    assert recorded_ranks("full", stage_of, timed, steps=3) == [0, 1, 2, 3]
    assert recorded_ranks("none", stage_of, timed, steps=1) == []


def test_the_levels_keep_different_spans_and_the_same_summary():
    job = _job()
    full = simulate(job, options=SimOptions(fold="none"), trace="full")
    auto = simulate(job, options=SimOptions(fold="none"), trace="auto")
    none = simulate(job, options=SimOptions(fold="none"), trace="none")
    assert {s.rank for s in full.trace.spans} == set(range(8))
    assert {s.rank for s in auto.trace.spans} == set(range(8))  # small: all of it fits
    assert none.trace.spans == [] and none.trace.meta["recorded_ranks"] == []
    assert none.summary["trace"] == {"level": "none", "recorded_ranks": []}
    for key in ("step_time_s", "compute_s", "peak_memory_bytes", "exposed_comm_s"):
        assert none.summary[key] == full.summary[key] == auto.summary[key]
    assert len(none.summary["compute_s"]) == 8


def test_save_writes_chunks_that_read_as_one_json_document(tmp_path, monkeypatch):
    monkeypatch.setattr("twin.trace.CHUNK", 7)
    res = simulate(_job(), options=SimOptions(fold="all"), trace="full")
    path = res.trace.save(tmp_path / "spans.json")
    assert path.read_text() == json.dumps(res.trace.to_dict(), separators=(",", ":"))
    back = Trace.load(res.trace.save(tmp_path / "spans.json.gz"))
    assert back.spans == res.trace.spans and back.meta == res.trace.meta


@pytest.mark.timeout(180)
def test_the_cli_writes_the_trace_it_is_asked_for(tmp_path):
    base = ("simulate", "model=tiny", "cluster=cpu_local", "cluster.gpus_per_node=4",
            "parallel=pp_1f1b", "parallel.global_batch_size=32", "report=false",
            "format=json", "force=true")
    out = paratwin(*base, "trace=none", f"out_dir={tmp_path / 'r'}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    s = json.loads(out.stdout)
    assert s["trace"]["level"] == "none" and not (tmp_path / "r" / "spans.json").exists()
    assert s["fast_forward"]["periods"] > 0 and s["fold"] == "all"
    out = paratwin(*base, "trace=full", "fast_forward=false", f"out_dir={tmp_path / 'r'}",
                   cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    s = json.loads(out.stdout)
    assert s["fast_forward"] is None and s["trace"]["level"] == "full"
    trace = Trace.load(tmp_path / "r" / "spans.json")
    assert {sp.rank for sp in trace.spans} == set(s["trace"]["recorded_ranks"])
    out = paratwin(*base, "trace=some", f"out_dir={tmp_path / 'x'}", cwd=tmp_path)
    assert out.returncode == 2 and "trace='some' is not one of auto|full|none" in out.stderr
    out = paratwin(*base, "fast_forward=maybe", f"out_dir={tmp_path / 'x'}", cwd=tmp_path)
    assert out.returncode == 2 and "fast_forward='maybe' must be true or false" in out.stderr
