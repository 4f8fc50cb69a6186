"""Context parallelism from the command line: `paratwin simulate parallel.cp=2` runs, the CP
groups show in the summary, and a CP plan that cannot work is one line with exit code 2."""

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


def test_search_refuses_cp_in_one_line(tmp_path):
    out = paratwin("search", *T, "parallel.cp=2", f"out_dir={tmp_path / 'run'}", cwd=ROOT)
    lines = [ln for ln in out.stderr.splitlines() if ln.strip() and "warning" not in ln]
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert "search does not enumerate or estimate context parallelism yet" in lines[0]
