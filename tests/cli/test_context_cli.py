"""Context parallelism from the command line: `paratwin simulate parallel.cp=2` runs, the CP
groups show in the summary, a CP plan that cannot work is one line with exit code 2, and
`paratwin search` ranks CP plans."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
T = ("model=tiny", "cluster=cpu_local", "cluster.gpus_per_node=4")


def paratwin(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "paratwin.main", *args], capture_output=True,
                          text=True, cwd=cwd, timeout=120)


def test_simulate_with_cp_on_the_command_line(tmp_path):
    out = paratwin("simulate", *T, "parallel.cp=2", "parallel.cp_method=allgather",
                   "parallel.cp_load_balance=none", "format=json", f"out_dir={tmp_path / 'run'}",
                   cwd=ROOT)
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)
    assert summary["world_size"] == 4 and summary["simulated_ranks"] == 2  # dp folded, not cp
    assert {"cp", "dp-cp"} <= set(summary["exposed_comm_s"])


def test_the_cp_preset_runs(tmp_path):
    out = paratwin("simulate", *T, "parallel=cp", f"out_dir={tmp_path / 'run'}", cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "cp=2 (ring, headtail)" in out.stdout


def test_a_cp_that_does_not_divide_the_sequence_is_one_line(tmp_path):
    out = paratwin("simulate", *T, "cluster.gpus_per_node=6", "parallel.cp=3",
                   f"out_dir={tmp_path / 'run'}", cwd=ROOT)
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert out.returncode == 2 and len(lines) == 1 and "Traceback" not in out.stderr
    assert "2 * cp = 6 does not divide model.seq_len=64" in lines[0]


def test_search_enumerates_and_ranks_cp_plans(tmp_path):
    """search lists CP plans (space.cp) with the base plan's cp_method; parallel.cp is
    searched, not fixed: a warning names space.cp."""
    out = paratwin("search", *T, "global_batch_size=8", "space.cp=[2]", "top=1", "pareto=0",
                   "workers=1", "report=false", "parallel.cp_method=allgather", "format=json",
                   f"out_dir={tmp_path / 'run'}", cwd=ROOT)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["simulated"] == 1 and result["estimated"]
    assert all(p["parallel"]["cp"] == 2 and p["parallel"]["cp_method"] == "allgather"
               for p in result["estimated"])
    warned = paratwin("search", *T, "global_batch_size=8", "parallel.cp=2", "top=0",
                      "workers=1", "report=false", f"out_dir={tmp_path / 'run2'}", cwd=ROOT)
    assert warned.returncode == 0, warned.stderr
    assert "space.cp=[2]" in warned.stderr
