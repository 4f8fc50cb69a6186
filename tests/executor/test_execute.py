"""`paratwin execute` replays every preset for real: each op once per step, collectives verified."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("torch")

from paratwin.config import CONF_DIR  # noqa: E402
from paratwin.verbs import execute  # noqa: E402
from tests.executor.helpers import alive, paratwin, rank_pids  # noqa: E402
from twin.schedule.check import memory_peak  # noqa: E402
from twin.schedule.ir import Schedule  # noqa: E402
from twin.spec import ConfigError  # noqa: E402
from twin.trace import Trace  # noqa: E402

PRESETS = sorted(p.stem for p in (CONF_DIR / "parallel").glob("*.yaml"))
WORLD = {"single": 1, "3d": 4, "hsdp": 4}


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_replays_with_verified_collectives(preset, tmp_path, execute_cfg, capsys):
    """The launcher runs in this process (composed as the CLI would); the ranks are real."""
    world = WORLD.get(preset, 2)
    out = tmp_path / "run"
    cfg = execute_cfg(f"parallel={preset}", "model=tiny", "cluster=cpu_local",
                      f"cluster.gpus_per_node={world}", "steps=2", "warmup=1", "verify=true",
                      "timeout_s=60", "format=json", f"out_dir={out}")
    summary = execute.run(cfg)
    assert json.loads(capsys.readouterr().out) == summary
    trace = Trace.load(out / "spans.json")
    programs = Schedule.load(out / "schedule.json").programs()
    assert sorted(programs) == list(range(world))
    # every op of the schedule appears exactly once per measured step, under its own name
    seen = Counter((s.rank, s.step, s.op) for s in trace.spans)
    for step in (0, 1):
        for rank, prog in programs.items():
            names = [op.name for op in prog.ops]
            assert all(seen[(rank, step, n)] == 1 for n in names)
    assert sum(seen.values()) == 2 * sum(len(p.ops) for p in programs.values())
    assert trace.steps() == [0, 1] and all(s.end_us >= s.start_us for s in trace.spans)
    meta = trace.meta
    assert meta["source"] == "executor" and meta["backend"] == "gloo" and meta["steps"] == 2
    assert meta["world_size"] == world and meta["verify"] and meta["job"]["parallel"]["dp"]
    # summary: the twin's fields plus the executor's
    assert summary["steps"] == 2 and summary["world_size"] == world
    assert summary["step_time_p10_s"] <= summary["step_time_s"] <= summary["step_time_p90_s"]
    assert summary["verify"] is True and summary["source"] == "executor"
    assert sorted(summary["host_issue_s"]) == sorted(map(str, programs))
    assert all(0 < t < 60 for t in summary["host_issue_s"].values())
    for rank, kinds in summary["host_issue_by_kind_s"].items():  # each rank's ops, by kind
        assert set(kinds) <= {op.kind for op in programs[int(rank)].ops}
        assert sum(kinds.values()) <= summary["host_issue_s"][rank] * 1.5
    for rank, prog in programs.items():
        measured = summary["measured_peak_memory_bytes"][str(rank)]
        allocated = sum(op.bytes for op in prog.ops if op.kind == "alloc")
        assert memory_peak(prog)[0] - 1 <= measured <= allocated + 1
    # nothing left running
    assert not any(alive(pid) for pid in rank_pids(out, world) if pid)
    assert (out / "trace.json").is_file() and (out / "config.yaml").is_file()


@pytest.mark.parametrize("args, message", [
    (["steps=0"], "steps=0 must be a whole number >= 1"),
    (["backend=nccl"], "backend=nccl runs one rank per GPU"),
    (["fault={kind: crash, rank: 5}"], "fault.rank=5 is outside 0..1"),
    (["fault={kind: explode}"], "fault={'kind': 'explode'} must be"),
    (["verify=true", "cluster.gpus_per_node=32"], "up to 24 ranks"),
    (["parallel=tp", "parallel.tp=3"], "tp=3"),
    (["model=llama3_8b"], "GB of host memory"),
])
def test_config_errors_stop_before_any_process_starts(args, message, tmp_path, execute_cfg):
    out = tmp_path / "never"
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
        execute.run(execute_cfg(*args, f"out_dir={out}"))
    assert not out.exists()


@pytest.mark.timeout(60)
def test_a_config_error_is_one_line_and_exit_code_2(tmp_path):
    res = paratwin("execute", "steps=0", "timeout_s=-1", f"out_dir={tmp_path / 'never'}")
    assert res.returncode == 2
    assert res.stderr.count("\n") == 1 and "steps=0" in res.stderr and "timeout_s=-1" in res.stderr
    assert not (tmp_path / "never").exists()


@pytest.mark.timeout(60)
def test_torchrun_launcher_prepares_the_run_directory(tmp_path):
    out = tmp_path / "prepared"
    res = paratwin("execute", "launcher=torchrun", "format=json", f"out_dir={out}")
    assert res.returncode == 0, res.stderr
    cmds = json.loads(res.stdout)["commands"]
    assert cmds["single_node"].startswith("torchrun --standalone --nnodes 1 --nproc-per-node 2")
    assert "--rdzv-backend c10d" in cmds["multi_node"] and "srun" in cmds["slurm"]
    for name in ("run.json", "schedule.json", "config.yaml"):
        assert (Path(out) / name).is_file()
    assert not (Path(out) / "spans.json").exists()


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_file_store_rendezvous(tmp_path, execute_cfg, capsys):
    out = tmp_path / "file"
    summary = execute.run(execute_cfg("rendezvous=file", "steps=1", "warmup=0", "parallel=zero2",
                                      f"out_dir={out}"))
    assert summary["steps"] == 1 and "run directory" in capsys.readouterr().out
    assert not (out / "store").exists()  # the FileStore is removed with the run
