"""`paratwin simulate` as a user runs it: default job, files, JSON, sweeps, errors."""

from __future__ import annotations

import json

import pytest

from tests.cli.test_inspect_cli import paratwin
from twin.trace import Trace

pytestmark = pytest.mark.timeout(180)


def test_default_job_writes_summary_and_trace(tmp_path):
    out = paratwin("simulate", "report=false", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "simulated llama3_8b on dgx_h100: 8 GPUs" in out.stdout and "fits" in out.stdout
    (run,) = (tmp_path / "reports" / "simulate").iterdir()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 8 and summary["fits_memory"] is True
    assert Trace.load(run / "spans.json").meta["source"] == "twin"
    assert json.loads((run / "trace.json").read_text())["traceEvents"]


def test_json_summary_and_folding_is_reported(tmp_path):
    out = paratwin("simulate", "model=tiny", "cluster=dgx_h100", "cluster.num_nodes=2",
                   "parallel=3d", "fold=all", "format=json", f"out_dir={tmp_path / 'r'}",
                   "report=false", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    s = json.loads(out.stdout)
    assert s["fold"] == "all" and s["simulated_ranks"] == 2 and s["world_size"] == 16


def test_infeasible_plan_still_simulates_and_says_so_loudly(tmp_path):
    out = paratwin("simulate", "model=llama3_70b", "parallel=ddp", "report=false", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "DOES NOT FIT" in out.stdout


def test_jitter_gives_a_spread(tmp_path):
    out = paratwin("simulate", "model=tiny", "cluster=cpu_local", "parallel=ddp", "steps=5",
                   "jitter=true", "format=json", "report=false", "calibration=" +
                   str(_profile(tmp_path)), cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    s = json.loads(out.stdout)
    assert s["steps"] == 5 and s["step_time_p10_s"] < s["step_time_p90_s"]


def _profile(tmp_path):
    import dataclasses

    from twin.cost import default_cost_model
    from twin.spec import ClusterSpec, GPUSpec
    cost = default_cost_model(ClusterSpec(gpu=GPUSpec(peak_tflops={"bf16": 1.0})))
    path = tmp_path / "noisy.yaml"
    dataclasses.replace(cost, compute_cv=0.2, comm_cv=0.3).save(path)
    return path


def test_sweep_runs_each_point_in_its_own_directory(tmp_path):
    out = paratwin("simulate", "-m", "model=tiny", "cluster=cpu_local", "parallel=tp,pp_1f1b",
                   "report=false", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    runs = list((tmp_path / "reports" / "multirun" / "simulate").glob("*/*/summary.json"))
    assert len(runs) == 2


@pytest.mark.parametrize("args, text", [
    (["calibration=nope"], "calibration=nope: no profile at"),
    (["fold=some"], "fold='some' is not one of"),
    (["whatif.straggler_rank=99"], "whatif.straggler_rank=99 is out of range"),
])
def test_bad_options_are_named(tmp_path, args, text):
    out = paratwin("simulate", "report=false", *args, cwd=tmp_path)
    assert out.returncode == 2 and text in out.stderr and "Traceback" not in out.stderr


def test_a_foreign_profile_is_refused_and_left_alone(tmp_path):
    bad = tmp_path / "p.yaml"
    bad.write_text("name: x\nfoo: 1\n")
    out = paratwin("simulate", f"calibration={bad}", "report=false", cwd=tmp_path)
    assert out.returncode == 2 and "not a paratwin calibration profile" in out.stderr
    assert bad.read_text() == "name: x\nfoo: 1\n"
