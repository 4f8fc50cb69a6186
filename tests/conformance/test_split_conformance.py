"""torch.distributed.pipelining's ScheduleInterleavedZeroBubble (one stage per rank: ZB-H1),
ScheduleZBVZeroBubble, ScheduleDualPipeV and a CSV table run by _PipelineScheduleRuntime,
on gloo ranks, against the schedule: no difference, the losses of one process."""

from __future__ import annotations

import json

import pytest

from tests.conformance.test_compare import tiny
from tests.conftest import cluster
from twin.schedule.tables import stage_table
from twin.schedule.torchcsv import format_csv
from twin.spec import ConfigError, ParallelPlan, build_job

pytest.importorskip("torch")

from executor.conformance.parallelize import check_plan  # noqa: E402
from executor.conformance.runner import conform  # noqa: E402

PLANS = {  # name: (world size, layers, plan)
    "zb_h1": (2, 4, dict(pp=2, pp_schedule="zb_h1")),
    "zb_v": (2, 4, dict(pp=2, pp_schedule="zb_v", pp_virtual_stages=2)),
    "dualpipev": (2, 4, dict(pp=2, pp_schedule="dualpipev", pp_virtual_stages=2)),
    "zb_h1_pp4": (4, 4, dict(pp=4, pp_schedule="zb_h1")),
    "zb_v_pp4": (4, 8, dict(pp=4, pp_schedule="zb_v", pp_virtual_stages=2)),
    "dualpipev_pp4": (4, 8, dict(pp=4, pp_schedule="dualpipev", pp_virtual_stages=2)),
}


def _check(res):
    assert res["differences"] == [], json.dumps(res["differences"], indent=1)
    assert res["losses"]["match"] and max(res["losses"]["relative_error"]) <= 1e-5
    for rows in res["ranks"].values():
        assert rows and all(r["ir_count"] == r["torch_count"] and r["ir_bytes"] == r["torch_bytes"]
                            for r in rows)


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", PLANS)
def test_torch_split_schedules_issue_what_the_schedule_says(name, tmp_path):
    world, layers, plan = PLANS[name]
    job = build_job(tiny(num_layers=layers), cluster(gpus=world), ParallelPlan(**plan))
    _check(conform(job, tmp_path / "run", steps=3, timeout_s=120, log=lambda m: None))


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_a_csv_table_runs_in_torch_as_in_the_schedule(tmp_path):
    table = tmp_path / "dualpipev.csv"
    table.write_text(format_csv([stage_table("dualpipev", 2, 6, s, 2) for s in range(2)]))
    plan = ParallelPlan(pp=2, pp_virtual_stages=2, pp_schedule_csv=str(table),
                        global_batch_size=6)
    job = build_job(tiny(), cluster(gpus=2), plan)
    _check(conform(job, tmp_path / "run", steps=3, timeout_s=120, log=lambda m: None))


def test_split_backward_with_ddp_is_refused_with_the_reason():
    job = build_job(tiny(), cluster(gpus=4), ParallelPlan(pp=2, dp=2, pp_schedule="zb_h1"))
    with pytest.raises(ConfigError, match="split backward .* with DDP leaves some ranks"):
        check_plan(job)


def test_zb_h1_micro_batches_torch_cannot_round_are_refused():
    job = build_job(tiny(), cluster(gpus=2),
                    ParallelPlan(pp=2, pp_schedule="zb_h1", global_batch_size=5))
    with pytest.raises(ConfigError, match="multiple of max\\(1, m // pp\\) = 2"):
        check_plan(job)
