"""write_report and `paratwin report`: sections by content, one offline file, errors in one line."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from paratwin.verbs.report import positional_runs
from twin.report import Options, write_report

pytestmark = pytest.mark.timeout(180)


def sections_of(html: str) -> list[str]:
    return re.findall(r"<h2 id='([a-z]+)", html)


def test_single_run_has_summary_timeline_memory_and_is_offline(runs, tmp_path):
    out = write_report([runs["single"]], tmp_path / "r.html")
    html = out.read_text()
    assert sections_of(html) == ["summary", "timeline", "memory"]
    assert html.count("Copyright") < 50 and html.count("plotly.js v") == 1  # inlined once
    assert not re.search(r"<script[^>]+src=", html) and not re.search(r"<link[^>]+href=.http", html)
    assert (runs["single"] / "trace.json").is_file()
    assert "could not be drawn" not in html


def test_default_output_is_the_first_run_directory(runs):
    assert write_report([runs["pp"]], options=Options(chrome=False)) == runs["pp"] / "report.html"


def test_two_runs_of_one_schedule_get_an_overlay(runs, tmp_path):
    html = write_report([runs["single"], runs["jitter"]], tmp_path).read_text()
    assert "overlay" in sections_of(html) and "every op of each trace has its partner" in html


def test_sweep_directory_gets_scaling(runs, tmp_path):
    html = write_report([runs["sweep"]], tmp_path / "s.html").read_text()
    assert "sweep" in sections_of(html) and "scaling efficiency" in html
    assert "x2 GPUs" in html


def test_bench_directory_gets_calibration_only(bench_dir, tmp_path):
    html = write_report([bench_dir], tmp_path / "c.html").read_text()
    assert sections_of(html) == ["calibration"]


def test_positional_directories_become_runs(tmp_path):
    d = tmp_path / "0-cluster.num_nodes=2"
    d.mkdir()
    assert positional_runs(["a", str(d), "out=x.html"]) == [f"runs=['a','{d}']", "out=x.html"]
    assert positional_runs(["out=x.html", "a"]) == ["out=x.html", "a"]
    assert positional_runs(["it's"]) == ["runs=['it\\'s']"]


def paratwin(*args, cwd):
    return subprocess.run([sys.executable, "-m", "paratwin.main", "report", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def test_cli_takes_directories_positionally(runs, tmp_path):
    res = paratwin(str(runs["single"]), str(runs["jitter"]), f"out={tmp_path}/both.html",
                   "chrome=false", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert f"wrote {tmp_path}/both.html" in res.stdout
    assert "overlay" in sections_of((tmp_path / "both.html").read_text())


@pytest.mark.parametrize("args, words", [
    ([], "no run directory given"),
    (["/nonexistent/run"], "does not exist"),
    (["run=/tmp", "max_spans=0"], "max_spans=0 must be at least 1"),
])
def test_cli_errors_are_one_line_exit_2(tmp_path, args, words):
    res = paratwin(*args, cwd=tmp_path)
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and words in res.stderr
