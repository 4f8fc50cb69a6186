"""`paratwin schedule format=torch-csv` writes torch's pipeline table; `parallel.pp_schedule_csv`
runs one; a bad or deadlocking table is one line (exit 2) and nothing is written."""

from __future__ import annotations

from tests.cli.test_inspect_cli import paratwin
from twin.schedule.tables import stage_table
from twin.schedule.torchcsv import format_csv

BASE = ("model=tiny", "cluster=cpu_local", "cluster.gpus_per_node=2")


def test_torch_csv_is_written_and_runs_again(tmp_path):
    table = tmp_path / "zbv.csv"
    out = paratwin("schedule", *BASE, "parallel=pp_zb_v", "format=torch-csv", f"out={table}",
                   cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert table.read_text() == format_csv([stage_table("zb_v", 2, 8, s, 2) for s in range(2)])
    assert table.read_text().splitlines()[0].startswith("0F0,0F1,0F2,3F0,3I0,3W0")
    again = paratwin("schedule", *BASE, "parallel=pp_1f1b", "parallel.pp_virtual_stages=2",
                     f"parallel.pp_schedule_csv={table}", "check=true", "head=0", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert "no deadlock" in again.stdout


def test_printed_without_out(tmp_path):
    out = paratwin("schedule", *BASE, "parallel=pp_dualpipev", "format=torch-csv", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "OVERLAP_F_B" in out.stdout and len(out.stdout.splitlines()) == 2


def test_a_foreign_file_is_not_overwritten(tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    out = paratwin("schedule", *BASE, "parallel=pp_zb_h1", "format=torch-csv", f"out={notes}",
                   cwd=tmp_path)
    assert out.returncode == 2 and "is not a pipeline action table" in out.stderr
    assert notes.read_text() == "my notes\n"


def test_a_deadlocking_table_is_one_line_and_nothing_is_written(tmp_path):
    table = tmp_path / "dead.csv"
    table.write_text("0F0,0B0,0F1,0B1\n1F0,1F1,1B0,1B1\n")
    dump = tmp_path / "prog.json"
    out = paratwin("schedule", *BASE, "parallel=pp_1f1b", "parallel.global_batch_size=2",
                   f"parallel.pp_schedule_csv={table}", f"out={dump}", cwd=tmp_path)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "deadlocks: row 0 blocks at action 1 (0B0)" in lines[0]
    assert not dump.exists()


def test_zb_v_needs_two_chunks_in_one_line(tmp_path):
    out = paratwin("schedule", *BASE, "parallel=pp_1f1b", "parallel.pp_schedule=zb_v", cwd=tmp_path)
    assert out.returncode == 2
    assert "needs exactly 2 chunks per rank" in out.stderr.strip().splitlines()[-1]
