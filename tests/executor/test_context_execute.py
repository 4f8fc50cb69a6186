"""Context-parallel schedules replayed for real on gloo: the ring's KV and dK/dV send/recv
pairs, the all-gather / reduce-scatter of K and V, Ulysses' all-to-alls, and the dp x cp
gradient reductions, every result verified (each rank's program walked in full)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")


from paratwin.verbs import execute  # noqa: E402
from twin.schedule.ir import Schedule  # noqa: E402
from twin.trace import Trace  # noqa: E402


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
@pytest.mark.parametrize("world, plan, kinds", [
    # ring, head-tail balanced, FSDP over dp x cp: KV and fp32 dK/dV around the pair
    (2, ["parallel=cp"], {("cp", "send"), ("cp", "recv"), ("dp-cp", "reduce_scatter")}),
    # all-gather of K and V with TP + SP, unbalanced (CP ranks run different programs), DDP
    (4, ["parallel=ddp", "parallel.cp=2", "parallel.tp=2", "parallel.sp=true",
         "parallel.cp_method=allgather", "parallel.cp_load_balance=none"],
     {("cp", "all_gather"), ("cp", "reduce_scatter"), ("dp-cp", "all_reduce")}),
    # Ulysses over the CP pair, pipelined over two stages
    (4, ["parallel=pp_1f1b", "parallel.cp=2", "parallel.cp_method=alltoall",
         "parallel.global_batch_size=4"], {("cp", "all_to_all"), ("pp", "send")}),
    # a ring of 4, unbalanced (four programs), ZeRO-1 over dp x cp
    (4, ["parallel=zero1", "parallel.cp=4", "parallel.cp_load_balance=none"],
     {("cp", "send"), ("dp-cp", "reduce_scatter"), ("dp-cp", "all_gather")}),
])
def test_cp_replays_with_verified_collectives(world, plan, kinds, tmp_path, execute_cfg, capsys):
    out = tmp_path / "run"
    cfg = execute_cfg("model=tiny", "cluster=cpu_local", f"cluster.gpus_per_node={world}",
                      *plan, "steps=1", "warmup=1", "verify=true", "timeout_s=90", "threads=1",
                      "report=false", "format=json", f"out_dir={out}")
    summary = execute.run(cfg)
    assert json.loads(capsys.readouterr().out) == summary
    programs = Schedule.load(out / "schedule.json").programs()
    ran_kinds = {(op.group_name, op.kind) for p in programs.values() for op in p.ops
                 if op.is_collective or op.is_p2p}
    assert kinds <= ran_kinds
    spans = Trace.load(out / "spans.json").spans
    ran = {(s.rank, s.op) for s in spans}
    for rank, prog in programs.items():  # every op of every rank, once
        assert all((rank, op.name) in ran for op in prog.ops)
