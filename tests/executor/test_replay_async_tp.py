"""Async TP's chunked steps (TP-group send/recv between every pair of peers) replay for real."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")

from tests.executor.helpers import paratwin  # noqa: E402
from twin.schedule.ir import Schedule  # noqa: E402
from twin.trace import Trace  # noqa: E402


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
@pytest.mark.parametrize("world", [2, 4])
def test_async_tp_plan_replays_every_op(world, tmp_path):
    out = tmp_path / "run"
    res = paratwin("execute", "parallel=tp_sp", f"parallel.tp={world}", "parallel.async_tp=true",
                   "parallel.compile=true", "model=tiny", "cluster=cpu_local",
                   f"cluster.gpus_per_node={world}", "steps=1", "warmup=0", "verify=true",
                   "timeout_s=60", "format=json", f"out_dir={out}", timeout=140)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["verify"] is True
    programs = Schedule.load(out / "schedule.json").programs()
    tp_p2p = [op for p in programs.values() for op in p.ops if op.is_p2p and op.group_name == "tp"]
    assert tp_p2p and {op.kind for op in tp_p2p} == {"send", "recv"}
    names = {(s.rank, s.op) for s in Trace.load(out / "spans.json").spans}
    assert all((r, op.name) in names for r, p in programs.items() for op in p.ops)
