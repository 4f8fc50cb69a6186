"""`paratwin inspect` as a user runs it: text, JSON, sweeps, and one-line config errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)


def paratwin(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "paratwin.main", *args], capture_output=True,
                          text=True, cwd=cwd, timeout=60)


def test_default_job_prints_the_memory_table(tmp_path):
    out = paratwin("inspect", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "llama3_8b on dgx_h100" in out.stdout and "fits in memory: yes" in out.stdout
    assert list(tmp_path.iterdir()) == []  # inspect writes nothing


def test_json_has_the_public_fields(tmp_path):
    out = paratwin("inspect", "model=llama3_70b", "cluster.num_nodes=8", "parallel=fsdp",
                   "parallel.tp=8", "format=json", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    rep = json.loads(out.stdout)
    assert rep["world_size"] == 64
    assert rep["params_total"] == pytest.approx(70.6e9, rel=1e-3)
    assert rep["flops_per_step"] > 0 and isinstance(rep["fits_memory"], bool)
    row = rep["ranks"][0]
    assert {"rank", "stage", "params", "memory_bytes"} <= set(row)
    assert {"params", "grads", "optimizer", "activations", "total"} <= set(row["memory_bytes"])
    assert row["memory_bytes"]["total"] == pytest.approx(
        sum(v for k, v in row["memory_bytes"].items() if k != "total"))


def test_one_row_per_pipeline_stage(tmp_path):
    out = paratwin("inspect", "model=tiny", "cluster=cpu_local", "cluster.gpus_per_node=4",
                   "parallel=3d", "format=json", cwd=tmp_path)
    rep = json.loads(out.stdout)
    assert [(r["rank"], r["stage"]) for r in rep["ranks"]] == [(0, 0), (2, 1)]


def test_config_error_is_one_line_and_exit_2(tmp_path):
    out = paratwin("inspect", "parallel.tp=3", cwd=tmp_path)
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr
    assert "tp=3 does not divide model.num_heads=32" in out.stderr


@pytest.mark.parametrize("arg, text", [
    ("model=llama3_7b", "model=llama3_7b is not a preset; choose one of"),
    ("parallel.tp=abc", "parallel.tp: Value 'abc'"),
    ("+parallel.tpp=2", "parallel.tpp is not a field; did you mean parallel.tp?"),
    ("format=yaml", "format='yaml' is not one of text|json"),
])
def test_bad_input_is_named(tmp_path, arg, text):
    out = paratwin("inspect", arg, cwd=tmp_path)
    assert out.returncode == 2 and text in out.stderr and "Traceback" not in out.stderr


def test_sweep_runs_each_point(tmp_path):
    out = paratwin("inspect", "-m", "parallel.tp=1,2", "format=json", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count('"world_size"') == 2


def test_usage_lists_the_verbs():
    out = paratwin("--help")
    assert out.returncode == 0 and "inspect" in out.stdout
    bad = paratwin("simulat")
    assert bad.returncode == 2 and "unknown verb 'simulat'" in bad.stderr


def test_what_if_path_needs_no_torch(tmp_path):
    code = ("import sys; from paratwin.main import main; sys.argv=['paratwin','inspect'];\n"
            "try:\n    main()\nfinally:\n    assert 'torch' not in sys.modules, 'torch imported'")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=tmp_path, timeout=60)
    assert out.returncode == 0, out.stderr


def test_a_plan_that_does_not_fit_names_the_changes_that_would(tmp_path):
    """Llama-3 70B with FSDP x TP8 on 64 H100s without SP or checkpointing is over 80 GB:
    the report lists the single plan changes that fit (``fixes``), and the text says them."""
    args = ("inspect", "model=llama3_70b", "cluster.num_nodes=8", "parallel=fsdp", "parallel.tp=8")
    out = paratwin(*args, "format=json", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    rep = json.loads(out.stdout)
    assert rep["fits_memory"] is False and rep["fixes"]
    assert all(f["fits"] and f["peak_memory_bytes"] <= rep["hbm_bytes"] for f in rep["fixes"])
    assert {"parallel.sp": True} in [f["changes"] for f in rep["fixes"]]
    text = paratwin(*args, cwd=tmp_path).stdout
    assert "fits with parallel.sp=true (" in text
    fits = json.loads(paratwin("inspect", "format=json", cwd=tmp_path).stdout)
    assert fits["fits_memory"] is True and "fixes" not in fits
