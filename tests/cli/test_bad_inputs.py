"""Issue 12's reproductions through the CLI, as an adversarial user runs them: every bad
input is one line on stderr with exit code 2 and no traceback, nothing is accepted
silently, and no file the user had is lost or replaced."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

T = ("model=tiny", "cluster=cpu_local")


def paratwin(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "paratwin.main", *args], capture_output=True,
                          text=True, cwd=cwd, timeout=120)


def one_line(out: subprocess.CompletedProcess, text: str, code: int = 2) -> str:
    """The run failed with ``code`` and said ``text`` in one line, without a traceback."""
    err = out.stderr
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.strip() and "warning:" not in ln]
    assert out.returncode == code, (out.returncode, err)
    assert len(lines) == 1, err
    assert text in lines[0], err
    return lines[0]


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


# --- item 4 and 7: top-level fields, misspelt keys, unreadable overrides ---------------

BAD_FIELDS = [
    ("simulate", ("steps=abc",), "steps='abc' must be a whole number"),
    ("simulate", ("seed=abc",), "seed='abc' must be a whole number"),
    ("simulate", ("jitter=maybe",), "jitter='maybe' must be true or false"),
    ("simulate", ("steps=1,abc", "-m"), "steps='abc' must be a whole number"),
    ("execute", ("steps=abc",), "steps='abc' must be a whole number"),
    ("schedule", ("rank=abc",), "rank='abc' must be a whole number"),
    ("schedule", ("head=abc",), "head='abc' must be a whole number"),
    ("report", ("max_spans=abc",), "max_spans='abc' must be a whole number"),
    ("simulate", ("parallel.foo=1",), "parallel.foo is not a field"),
    ("simulate", ("+parallel.foo=1",), "parallel.foo is not a field"),
    ("simulate", ("+stepz=3",), "stepz is not a field; did you mean steps?"),
    ("simulate", ("stepz=3",), "stepz is not a field; did you mean steps?"),
    ("inspect", ("paralel.tp=2",), "paralel.tp is not a field; did you mean parallel.tp?"),
    ("simulate", ("whatif.degraded_factr=0.5",), "did you mean whatif.degraded_factor?"),
    ("simulate", ("steps=[",), "cannot read the override 'steps=['"),
    ("simulate", (*T, "whatif.degraded_link=nic_out:a:b"), "the indices must be integers"),
    ("simulate", (*T, "parallel=ddp", "parallel.legacy_dp=true", "fold=dp"), "fold=dp"),
    # item 5: what-ifs
    ("simulate", ("model=tiny", "cluster=dgx_h100", "cluster.num_nodes=2", "parallel=ddp",
                  "whatif.degraded_link=nic_out:7:0"), "nic_out:7:0"),
    ("simulate", (*T, "parallel=ddp", "whatif.degraded_link=out:0",
                  "whatif.degraded_factor=0"), "degraded_factor"),
    ("simulate", (*T, "parallel=ddp", "whatif.straggler_rank=1", "whatif.straggler_factor=0"),
     "straggler_factor"),
    ("simulate", (*T, "parallel=ddp", "whatif.straggler_rank=1", "whatif.straggler_factor=-2"),
     "straggler_factor"),
    ("simulate", (*T, "parallel=ddp", "whatif.straggler_rank=abc"), "straggler_rank"),
    # item 6: profiles
    ("calibrate", ("name=../../x",), "name="),
    # item 8: unbounded work
    ("simulate", ("cluster=dgx_h100", "cluster.num_nodes=10000000"), "GPUs"),
    ("simulate", (*T, "parallel=ddp", "parallel.global_batch_size=20000000"), "micro-batch"),
]


@pytest.mark.parametrize("verb, args, text", BAD_FIELDS, ids=[" ".join(c[1]) for c in BAD_FIELDS])
def test_bad_field_is_one_line(tmp_path, verb, args, text):
    one_line(paratwin(verb, *args, cwd=tmp_path), text)
    assert not (tmp_path / "reports").exists() or verb == "simulate" and "-m" in args


def test_calibration_that_is_a_directory_or_not_a_profile(tmp_path):
    one_line(paratwin("simulate", *T, "parallel=ddp", f"calibration={tmp_path}", cwd=tmp_path),
             "is a directory")
    bad = tmp_path / "bad.yaml"
    bad.write_text("format: paratwin-profile\nversion: 1\ngemm: {efficiency: -0.5, foo: 1}\n")
    line = one_line(paratwin("simulate", *T, "parallel=ddp", f"calibration={bad}", cwd=tmp_path),
                    "gemm")
    assert "foo" in line or "efficiency" in line


def test_suspicious_inputs_are_not_accepted_silently(tmp_path):
    """Legal but without effect, or from another machine: a warning line, the run goes on."""
    cases = [(("model=tiny", "cluster=dgx_h100", "parallel=ddp", "calibration=cpu_local"),
              "cpu_local"),
             ((*T, "parallel=ddp", "jitter=true", "steps=2", "calibration=null"), "noise"),
             ((*T, "parallel=ddp", "whatif.straggler_factor=2"), "straggler_rank")]
    for args, text in cases:
        out = paratwin("simulate", *args, "report=false", f"out_dir={tmp_path / text}",
                       cwd=tmp_path)
        assert out.returncode == 0, out.stderr
        warns = [ln for ln in out.stderr.splitlines() if "warning:" in ln]
        assert any(text in ln for ln in warns), (args, out.stderr)


def test_debug_true_shows_the_traceback(tmp_path):
    (tmp_path / "d").mkdir()
    args = ("schedule", *T, "parallel=ddp", f"out={tmp_path / 'd'}")
    one_line(paratwin(*args, cwd=tmp_path), "is a directory; give a file path for the schedule")
    out = paratwin(*args, "debug=true", cwd=tmp_path)
    assert out.returncode != 0 and "Traceback" in out.stderr and "RunDirError" in out.stderr


# --- item 4: OS errors and foreign files as input ---------------------------------------

def test_out_dir_that_is_a_file(tmp_path):
    f = tmp_path / "afile"
    f.write_text("mine\n")
    one_line(paratwin("simulate", *T, "parallel=ddp", f"out_dir={f}", cwd=tmp_path),
             "is a file, not a directory")
    assert f.read_text() == "mine\n"


def test_schedule_out_with_a_missing_parent_is_created(tmp_path):
    out = paratwin("schedule", *T, "parallel=ddp", f"out={tmp_path / 'new' / 'sched.json'}",
                   cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert json.loads((tmp_path / "new" / "sched.json").read_text())["format"] == "paratwin-schedule"


def test_read_only_directory(tmp_path):
    if os.geteuid() == 0:  # root writes anywhere but in a kernel filesystem
        one_line(paratwin("simulate", *T, "parallel=ddp", "out_dir=/sys/paratwin-test/run",
                          cwd=tmp_path), "Operation not permitted")
        return
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        one_line(paratwin("simulate", *T, "parallel=ddp", f"out_dir={ro / 'run'}", cwd=tmp_path),
                 "Permission denied")
    finally:
        ro.chmod(0o700)


def test_name_too_long(tmp_path):
    one_line(paratwin("simulate", *T, "parallel=ddp", f"out_dir={tmp_path / ('x' * 300)}",
                      cwd=tmp_path), "File name too long")


def test_report_on_a_summary_that_is_a_json_list(tmp_path):
    d = tmp_path / "run"
    d.mkdir()
    (d / "summary.json").write_text("[1, 2]")
    one_line(paratwin("report", str(d), cwd=tmp_path), "is not a paratwin summary")
    assert (d / "summary.json").read_text() == "[1, 2]"
    assert sorted(p.name for p in d.iterdir()) == ["summary.json"]


# --- items 1 and 3: files the user had --------------------------------------------------

def _project(tmp_path: Path) -> Path:
    proj = tmp_path / "proj"
    (proj / "logs" / "old").mkdir(parents=True)
    (proj / "errors").mkdir()
    (proj / "logs" / "train.log").write_text("keep\n")
    (proj / "logs" / "old" / "x.log").write_text("keep\n")
    (proj / "errors" / "notes.txt").write_text("keep\n")
    (proj / "summary.json").write_text("{}")
    return proj


@pytest.mark.multiprocess
def test_execute_never_deletes_a_users_files(tmp_path):
    proj = _project(tmp_path)
    before = snapshot(proj)
    one_line(paratwin("execute", *T, "parallel=ddp", "launcher=torchrun", f"out_dir={proj}",
                      cwd=tmp_path), "already holds summary.json")
    assert snapshot(proj) == before
    # force=true replaces paratwin's own names only: the user's other files stay
    out = paratwin("execute", *T, "parallel=ddp", "launcher=torchrun", f"out_dir={proj}",
                   "force=true", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    after = snapshot(proj)
    for name in ("logs/train.log", "logs/old/x.log", "errors/notes.txt"):
        assert after[name] == before[name]
    # and a second run of the same verb there is fine (the directory is its own now)
    out = paratwin("execute", *T, "parallel=ddp", "launcher=torchrun", f"out_dir={proj}",
                   cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert snapshot(proj)["logs/train.log"] == b"keep\n"


@pytest.mark.multiprocess
def test_simulate_refuses_a_directory_execute_wrote(tmp_path):
    run = tmp_path / "ex"
    assert paratwin("execute", *T, "parallel=ddp", "launcher=torchrun", f"out_dir={run}",
                    cwd=tmp_path).returncode == 0
    before = snapshot(run)
    one_line(paratwin("simulate", *T, "parallel=ddp", f"out_dir={run}", cwd=tmp_path),
             "holds a run written by `paratwin execute`")
    assert snapshot(run) == before


def test_schedule_and_report_refuse_to_overwrite_a_users_file(tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("mine\n")
    one_line(paratwin("schedule", *T, "parallel=ddp", f"out={notes}", cwd=tmp_path),
             "is not a paratwin schedule; it was not overwritten")
    run = tmp_path / "sim"
    assert paratwin("simulate", *T, "parallel=ddp", f"out_dir={run}", "report=false",
                    cwd=tmp_path).returncode == 0
    one_line(paratwin("report", str(run), f"out={notes}", cwd=tmp_path),
             "is not a paratwin report; it was not overwritten")
    assert notes.read_text() == "mine\n"
    # a schedule paratwin wrote may be written again
    sched = tmp_path / "s.json"
    for _ in range(2):
        assert paratwin("schedule", *T, "parallel=ddp", f"out={sched}", cwd=tmp_path).returncode == 0


def test_foreign_trace_json_and_report_html_in_a_run_directory_are_kept(tmp_path):
    run = tmp_path / "sim"
    assert paratwin("simulate", *T, "parallel=ddp", f"out_dir={run}", "report=false",
                    cwd=tmp_path).returncode == 0
    (run / "trace.json").write_text('{"mine": true}')
    (run / "report.html").write_text("<html>my notes</html>")
    one_line(paratwin("report", str(run), cwd=tmp_path), "is not a paratwin report")
    out = paratwin("report", str(run), f"out={tmp_path / 'r.html'}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert (run / "trace.json").read_text() == '{"mine": true}'
    assert (run / "report.html").read_text() == "<html>my notes</html>"
    assert json.loads((run / "chrome_trace.json").read_text())["otherData"]["generator"] == "paratwin"


# --- item 9 -----------------------------------------------------------------------------

def test_sweep_runs_every_point_and_reports_the_bad_ones(tmp_path):
    out = paratwin("inspect", *T, "parallel=ddp", "parallel.tp=1,3,2", "format=json", "-m",
                   cwd=tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "1 point(s) of the sweep failed" in out.stderr and "tp=3" in out.stderr
    assert out.stdout.count('"world_size"') == 2  # tp=1 and tp=2 ran


def test_rank_entry_on_a_damaged_run_json(tmp_path):
    (tmp_path / "run.json").write_text('{"task": "rep')
    out = subprocess.run([sys.executable, "-m", "executor.rank", str(tmp_path)], capture_output=True,
                         text=True, timeout=60, cwd=Path(__file__).resolve().parents[2])
    one_line(out, "run.json is not valid JSON")


@pytest.mark.multiprocess
def test_seconds_may_be_fractional(tmp_path):
    out = paratwin("execute", *T, "parallel=ddp", "launcher=torchrun", "timeout_s=1.5",
                   f"out_dir={tmp_path / 'x'}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert json.loads((tmp_path / "x" / "run.json").read_text())["timeout_s"] == 1.5
