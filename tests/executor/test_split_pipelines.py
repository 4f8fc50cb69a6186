"""The executor replays split-backward pipelines (ZB-H1, ZB-V, DualPipeV, a torch CSV table)
on 3-4 gloo ranks with every collective and p2p verified, each op once per step."""

from __future__ import annotations

from collections import Counter

import pytest

pytest.importorskip("torch")


from paratwin.verbs import execute  # noqa: E402
from tests.executor.helpers import alive, rank_pids  # noqa: E402
from twin.schedule.ir import Schedule  # noqa: E402
from twin.schedule.tables import stage_table  # noqa: E402
from twin.schedule.torchcsv import format_csv  # noqa: E402
from twin.trace import Trace  # noqa: E402


def _run(execute_cfg, out, world, *overrides):
    # threads=1: one torch thread per rank; port=null: a free port (rendezvous tcp)
    cfg = execute_cfg("model=tiny", "cluster=cpu_local", f"cluster.gpus_per_node={world}",
                      "steps=2", "warmup=1", "verify=true", "timeout_s=60", "threads=1",
                      "port=null", "format=json", f"out_dir={out}", *overrides)
    summary = execute.run(cfg)
    trace = Trace.load(out / "spans.json")
    programs = Schedule.load(out / "schedule.json").programs()
    seen = Counter((s.rank, s.step, s.op) for s in trace.spans)
    for step in (0, 1):
        for rank, prog in programs.items():
            assert all(seen[(rank, step, op.name)] == 1 for op in prog.ops)
    assert summary["verify"] is True and summary["world_size"] == world
    assert not any(alive(pid) for pid in rank_pids(out, world) if pid)
    return programs


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
@pytest.mark.parametrize("world, overrides", [
    (4, ("parallel=pp_zb_h1", "parallel.pp=4")),
    (4, ("parallel=pp_zb_v", "model.num_layers=8", "parallel.pp=4")),
    (4, ("parallel=pp_dualpipev", "parallel.dp=2")),  # pp=2 x dp=2: DDP buckets after W
    (3, ("parallel=pp_zb_v", "parallel.pp=3", "model.num_layers=6")),
])
def test_split_pipelines_replay_verified(world, overrides, tmp_path, execute_cfg):
    programs = _run(execute_cfg, tmp_path / "run", world, *overrides)
    kinds = Counter(op.kind for p in programs.values() for op in p.ops)
    assert kinds["send"] == kinds["recv"] > 0


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_a_torch_csv_table_replays(tmp_path, execute_cfg):
    table = tmp_path / "zbv.csv"
    table.write_text(format_csv([stage_table("zb_v", 4, 8, s, 2) for s in range(4)]))
    programs = _run(execute_cfg, tmp_path / "run", 4, "parallel=pp_1f1b", "parallel.pp=4",
                    "model.num_layers=8", "parallel.pp_virtual_stages=2",
                    "parallel.global_batch_size=8", f"parallel.pp_schedule_csv={table}")
    assert any(op.name.endswith("lm_head") for op in programs[0].ops)  # the V's head: rank 0
