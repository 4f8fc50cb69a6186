"""`paratwin calibrate runs=FILE`: a profile from measured step times, cross-validated; a bad
row is one line naming it, and nothing is written."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import numpy as np
import pytest

ROWS = [  # model, parallel preset, tp, dp, micro-batch, step time (ms): made-up measurements
    ("tiny", "ddp", 1, 2, 1, 41.0), ("tiny", "ddp", 1, 2, 2, 63.0), ("tiny", "tp", 2, 1, 1, 55.0),
    ("tiny", "tp", 2, 1, 2, 80.0), ("tiny", "ddp", 1, 2, 4, 110.0), ("tiny", "tp", 2, 1, 4, 131.0),
]


def _runs(tmp_path, rows=ROWS):
    path = tmp_path / "runs.csv"
    with path.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["name", "model", "cluster", "parallel", "parallel.tp", "parallel.dp",
                    "parallel.micro_batch_size", "parallel.global_batch_size", "step_time_ms"])
        for k, (m, p, tp, dp, mb, ms) in enumerate(rows):
            w.writerow([f"r{k}", m, "cpu_local", p, tp, dp, mb, mb * dp * 2, ms])
    return path


def paratwin(*args, cwd):
    return subprocess.run([sys.executable, "-m", "paratwin.main", *args], capture_output=True,
                          text=True, cwd=cwd, timeout=600)


def test_a_profile_from_measured_runs_cross_validated(tmp_path):
    out = paratwin("calibrate", f"runs={_runs(tmp_path)}", "folds=2", "workers=1",
                   f"out={tmp_path / 'p.yaml'}", f"out_dir={tmp_path / 'c'}", "format=json",
                   cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout)
    assert report["rows"] == 6 and report["held_out"]["rows"] == 6
    # no run has a pipeline: its send/recv latency was not measured, and the log says so
    assert report["unexercised"] == ["p2p_latency_us"]
    assert "no run's step depends on p2p_latency_us" in out.stderr
    assert (tmp_path / "p.yaml").is_file() and (tmp_path / "c" / "profile.yaml").is_file()
    with open(tmp_path / "c" / "runs_modelled.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 6 and all(float(r["predicted_s"]) > 0 for r in rows)
    assert {r["split"] for r in rows} == {"fold 1/2", "fold 2/2"}
    sim = paratwin("simulate", "model=tiny", "cluster=cpu_local", "parallel=ddp",
                   f"calibration={tmp_path / 'p.yaml'}", "report=false", "format=json",
                   f"out_dir={tmp_path / 's'}", cwd=tmp_path)
    assert sim.returncode == 0, sim.stderr
    assert "was fitted on" not in sim.stderr  # a CPU profile of this very cluster: no warning
    # a second fit can start from the first (start=): what a traces fit measured stays put
    again = paratwin("calibrate", f"runs={_runs(tmp_path)}", "folds=0", "workers=1",
                     f"start={tmp_path / 'p.yaml'}", f"out={tmp_path / 'q.yaml'}",
                     f"out_dir={tmp_path / 'c2'}", cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-2000:]
    from twin.cost import CostModel
    prov = CostModel.load(tmp_path / "q.yaml").provenance
    assert prov["start"] == CostModel.load(tmp_path / "p.yaml").name and prov["backend"] == "gloo"


def test_a_bad_row_is_named_and_nothing_is_written(tmp_path):
    bad = list(ROWS)
    bad[1] = ("tiny", "ddp", 1, 2, 1, -3.0)
    out = paratwin("calibrate", f"runs={_runs(tmp_path, bad)}", f"out={tmp_path / 'p.yaml'}",
                   f"out_dir={tmp_path / 'c'}", cwd=tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "line 3: step_time_ms=-3.0 must be a positive number" in out.stderr
    assert not (tmp_path / "p.yaml").exists() and not (tmp_path / "c").exists()
    bad[1] = ("tiny", "tp", 3, 1, 1, 50.0)  # a config that cannot work
    out = paratwin("calibrate", f"runs={_runs(tmp_path, bad)}", f"out={tmp_path / 'p.yaml'}",
                   f"out_dir={tmp_path / 'd'}", cwd=tmp_path)
    assert out.returncode == 2 and "r1:" in out.stderr and "tp" in out.stderr
    assert not (tmp_path / "p.yaml").exists()


def test_validate_holds_the_twin_against_a_runs_file_and_draws_it(tmp_path):
    out = paratwin("validate", f"runs={_runs(tmp_path)}", "workers=1", f"out_dir={tmp_path / 'v'}",
                   "format=json", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout)
    assert res["rows"] == 6 and res["max_abs_error"] >= res["mean_abs_error"] > 0
    with open(tmp_path / "v" / "runs_modelled.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 6 and len({r["model"] for r in rows}) == 1 and rows[0]["model"].startswith("tiny")
    assert all(float(r["predicted_s"]) > 0 for r in rows)
    html = (tmp_path / "v" / "report.html").read_text()
    assert "measured runs" in html and "mean |error|" in html


def test_a_gemm_ceiling_out_of_range_is_one_line_and_writes_nothing(tmp_path):
    out = paratwin("calibrate", f"runs={_runs(tmp_path)}", "gemm_ceiling=1.5",
                   f"out={tmp_path / 'p.yaml'}", f"out_dir={tmp_path / 'c'}", cwd=tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "gemm_ceiling=1.5 must be a fraction of peak in (0, 1]" in out.stderr
    assert not (tmp_path / "p.yaml").exists() and not (tmp_path / "c").exists()


def test_measured_kind_times_are_fitted_from_the_runs_file(tmp_path):
    """A runs file's gemm_s column (made up: twice what the fit without it predicts) moves the
    fitted GEMMs' cost towards it; a negative one is one line naming the row."""
    from paratwin.runs import jobs_from_runs
    from twin.calibrate.kindtime import KindRetimer
    from twin.cost import CostModel

    plain = _runs(tmp_path)
    out = paratwin("calibrate", f"runs={plain}", "folds=0", "workers=1",
                   f"out={tmp_path / 'p.yaml'}", f"out_dir={tmp_path / 'c'}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    jobs = [r.job for r in jobs_from_runs(plain, None)]

    def gemm_s(profile):
        cost = CostModel.load(profile)
        rt = KindRetimer(jobs, [{"gemm": 1.0}] * len(jobs), jobs[0].cluster.gpu, lambda _v: cost)
        return rt.predict(None)

    target = 2 * gemm_s(tmp_path / "p.yaml")
    rows = list(csv.reader(plain.open()))
    with (tmp_path / "kinds.csv").open("w", newline="") as fh:
        csv.writer(fh).writerows([rows[0] + ["gemm_s"]] + [r + [f"{t:.6g}"]
                                                           for r, t in zip(rows[1:], target)])
    out = paratwin("calibrate", f"runs={tmp_path / 'kinds.csv'}", "folds=0", "workers=1",
                   f"out={tmp_path / 'k.yaml'}", f"out_dir={tmp_path / 'ck'}", "format=json",
                   cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    fitted = json.loads(out.stdout)["kinds"]  # how the fit met them, in-sample
    assert list(fitted) == ["gemm"] and fitted["gemm"]["rows"] == 6
    before = np.abs(gemm_s(tmp_path / "p.yaml") / target - 1)
    after = np.abs(gemm_s(tmp_path / "k.yaml") / target - 1)
    assert np.median(after) < 0.5 * np.median(before)
    # validate runs= reports each measured kind's error under the profile it is given
    out = paratwin("validate", f"runs={tmp_path / 'kinds.csv'}", f"calibration={tmp_path / 'k.yaml'}",
                   "workers=1", "report=false", f"out_dir={tmp_path / 'v'}", "format=json", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    kinds = json.loads(out.stdout)["kinds"]
    assert list(kinds) == ["gemm"] and kinds["gemm"]["rows"] == 6
    assert kinds["gemm"]["median_abs_error"] == pytest.approx(np.median(after), abs=1e-6)
    with (tmp_path / "bad.csv").open("w", newline="") as fh:  # an empty cell: not measured
        csv.writer(fh).writerows([rows[0] + ["gemm_s"]] + [r + ["-1" if k == 2 else ""]
                                                           for k, r in enumerate(rows[1:], 1)])
    out = paratwin("calibrate", f"runs={tmp_path / 'bad.csv'}", f"out={tmp_path / 'b.yaml'}",
                   f"out_dir={tmp_path / 'cb'}", cwd=tmp_path)
    assert out.returncode == 2 and "line 3: gemm_s=-1 must be a positive number" in out.stderr
    assert not (tmp_path / "b.yaml").exists() and not (tmp_path / "cb").exists()
