"""`paratwin schedule`: text dump, JSON summary, JSON program file, checks."""

from __future__ import annotations

import json

from tests.cli.test_inspect_cli import paratwin
from twin.schedule.ir import Schedule


def test_text_dump_and_file(tmp_path):
    out = paratwin("schedule", "model=tiny", "cluster=cpu_local", "cluster.gpus_per_node=4",
                   "parallel=3d", "rank=2", "check=true", f"out={tmp_path / 'r2.json'}",
                   cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "rank 2:" in out.stdout and "no deadlock" in out.stdout
    sched = Schedule.load(tmp_path / "r2.json")
    assert len(sched.program(2).ops) > 0 and sched.job.parallel.tp == 2


def test_json_summary_fields(tmp_path):
    out = paratwin("schedule", "model=tiny", "cluster=cpu_local", "parallel=fsdp", "format=json",
                   cwd=tmp_path)
    rep = json.loads(out.stdout)
    assert rep["ops"] == sum(rep["by_kind"].values())
    kinds = {(c["group"], c["kind"]) for c in rep["collectives"]}
    assert ("dp", "all_gather") in kinds and ("dp", "reduce_scatter") in kinds
    assert all({"group", "kind", "count", "bytes"} <= set(c) for c in rep["collectives"])


def test_rank_out_of_range(tmp_path):
    out = paratwin("schedule", "model=tiny", "cluster=cpu_local", "rank=5", cwd=tmp_path)
    assert out.returncode == 2 and "rank=5 is out of range for world size 2" in out.stderr
