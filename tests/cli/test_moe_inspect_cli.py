"""`paratwin inspect` of a MoE preset: params_active beside params_total, expert groups."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)


def test_json_has_params_active_and_the_expert_groups(tmp_path):
    out = subprocess.run([sys.executable, "-m", "paratwin.main", "inspect", "model=mixtral_8x7b",
                          "cluster.num_nodes=2", "parallel=zero1", "parallel.ep=8",
                          "format=json"], capture_output=True, text=True, cwd=tmp_path,
                         timeout=100)
    assert out.returncode == 0, out.stderr
    rep = json.loads(out.stdout)
    assert rep["params_total"] == pytest.approx(46.7e9, abs=0.05e9)
    assert rep["params_active"] == pytest.approx(12.9e9, abs=0.05e9)
    groups = rep["ranks"][0]["groups"]
    assert groups["ep"]["size"] == 8 and groups["edp"]["size"] == 2
    assert [c["kind"] for c in groups["ep"]["collectives"]] == ["all_to_all"]


def test_a_bad_expert_plan_is_one_line_and_exit_code_2(tmp_path):
    out = subprocess.run([sys.executable, "-m", "paratwin.main", "inspect", "model=mixtral_8x7b",
                          "parallel=zero1", "parallel.ep=3"], capture_output=True, text=True,
                         cwd=tmp_path, timeout=100)
    assert out.returncode == 2
    assert "parallel.ep=3 does not divide model.moe.num_experts=8" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
