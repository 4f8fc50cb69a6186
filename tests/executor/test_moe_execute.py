"""MoE schedules replayed for real on gloo: uneven all-to-alls (all_to_all_single with split
sizes), ETP gathers and expert-data-parallel reductions, every result verified."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")


from paratwin.verbs import execute  # noqa: E402
from twin.schedule.ir import Schedule  # noqa: E402
from twin.trace import Trace  # noqa: E402

MOE = ("+model.moe={{num_experts: 8, experts_per_token: 2, moe_ffn_hidden_size: 64, "
       "shared_experts: 1, first_k_dense: 1, routing: skewed, routing_skew: 0.6{}}}")


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
@pytest.mark.parametrize("world, plan", [
    (2, ["parallel=ddp", "parallel.ep=2"]),  # with a capacity: the hot experts drop tokens
    # EP over the TP pair (etp=1, SP), experts reduced over DP (edp=2) by ZeRO-1
    (4, ["parallel=zero1", "parallel.tp=2", "parallel.sp=true", "parallel.ep=2",
         "parallel.etp=1"]),
    # ETP = TP: dispatch over DP, all-gather / reduce-scatter over the TP pair
    (4, ["parallel=ddp", "parallel.tp=2", "parallel.sp=true", "parallel.ep=2"]),
])
def test_moe_replays_with_verified_collectives(world, plan, tmp_path, execute_cfg, capsys):
    out = tmp_path / "run"
    moe = MOE.format(", capacity_factor: 1.0" if world == 2 else "")
    cfg = execute_cfg("model=tiny", moe, "cluster=cpu_local", f"cluster.gpus_per_node={world}",
                      *plan, "steps=1", "warmup=1", "verify=true", "timeout_s=90",
                      "report=false", "format=json", f"out_dir={out}")
    summary = execute.run(cfg)
    assert json.loads(capsys.readouterr().out) == summary
    programs = Schedule.load(out / "schedule.json").programs()
    a2a = [op for p in programs.values() for op in p.ops if op.kind == "all_to_all"]
    assert a2a and any(op.send_splits for op in a2a)  # uneven dispatch really ran
    spans = Trace.load(out / "spans.json").spans
    ran = {(s.rank, s.op) for s in spans}
    for rank, prog in programs.items():  # every op of every rank, once
        assert all((rank, op.name) in ran for op in prog.ops)
    groups = {op.group_name for p in programs.values() for op in p.ops if op.is_collective}
    assert "ep" in groups
