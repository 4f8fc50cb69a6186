"""Reading run directories: the trace by name or by content, sweeps expanded, errors that teach."""

from __future__ import annotations

import shutil

import pytest

from twin.metrics import summarize
from twin.report import rundir as rd


def test_loads_summary_trace_config_and_job(runs):
    run = rd.load(runs["single"])
    assert run.trace is not None and run.trace_path.name == "spans.json"
    assert run.job is not None and run.job.grid.world_size == 8 and run.source == "twin"
    assert run.summary["world_size"] == 8 and run.hbm_bytes == run.job.cluster.hbm_bytes


def test_trace_found_by_content_under_any_name_and_summary_computed(runs, tmp_path):
    d = tmp_path / "renamed"
    d.mkdir()
    shutil.copy(runs["pp"] / "spans.json", d / "whatever.json")
    (d / "trace.json").write_text('{"traceEvents": []}')  # a Chrome export: not the trace
    run = rd.load(d)
    assert run.trace_path.name == "whatever.json"
    # no summary.json and no config.yaml: the job comes from the trace's meta; the report
    # computes no summary itself, the caller's summarizer does (the CLI passes summarize)
    assert run.job is not None and run.summary is None and not run.summary_derived
    run = rd.load(d, summarize)
    assert run.summary == summarize(run.trace, run.job) and run.summary_derived


def test_gzipped_trace_is_found(runs, tmp_path):
    run = rd.load(runs["pp"])
    d = tmp_path / "gz"
    d.mkdir()
    run.trace.save(d / "t.json.gz")
    assert rd.load(d).trace_path.name == "t.json.gz"


def test_sweep_directory_expands_in_numeric_order(runs, tmp_path):
    paths = rd.expand([runs["sweep"]])
    assert [p.name.split("-")[0] for p in paths] == ["0", "1", "2"]
    ten = tmp_path / "ten"
    for name in ("10", "9", "2"):
        shutil.copytree(runs["pp"], ten / name)
    assert [p.name for p in rd.expand([ten])] == ["2", "9", "10"]


@pytest.mark.parametrize("make, words", [
    (lambda p: p / "missing", ["does not exist", "paratwin simulate"]),
    (lambda p: p, ["holds no paratwin trace (spans.json)", "out_dir=DIR"]),
])
def test_errors_name_the_fix(tmp_path, make, words):
    with pytest.raises(FileNotFoundError) as err:
        rd.expand([make(tmp_path)])
    assert all(w in str(err.value) for w in words)


def test_a_file_is_not_a_run_directory(runs):
    with pytest.raises(NotADirectoryError, match="give the run directory that holds it"):
        rd.expand([runs["single"] / "spans.json"])


def test_bench_directory_finds_only_benchmark_tables(bench_dir):
    run = rd.load(bench_dir)
    assert [p.name for p in run.bench_csvs] == ["collectives.csv", "kernels.csv"]
    assert run.trace is None and run.summary is None
