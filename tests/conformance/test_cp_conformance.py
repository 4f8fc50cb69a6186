"""Context parallelism trained with PyTorch on gloo ranks (the plain-PyTorch ring attention of
executor/conformance/ring.py inside the Llama-style model, DDP or FSDP2 over the dp x cp mesh)
against the schedule: every collective and p2p call of the compared step equals the
schedule's, and the losses equal the single-process run's to 1e-5."""

from __future__ import annotations

import json

import pytest

from tests.conformance.test_compare import tiny
from tests.conftest import cluster
from twin.spec import ConfigError, ParallelPlan, build_job

pytest.importorskip("torch")

from executor.conformance.parallelize import check_plan  # noqa: E402
from executor.conformance.runner import conform  # noqa: E402

SP_NORMS = dict(sp_norm_grad_sync="per_tensor")
PLANS = {  # name: (world size, plan)
    "ddp_cp2": (2, dict(cp=2)),
    "fsdp2_dp2_cp2_none": (4, dict(zero_stage=3, cp=2, cp_load_balance="none")),
    "ddp_cp4": (4, dict(cp=4, cp_load_balance="none", global_batch_size=2)),
    "fsdp2_tp_sp_cp2": (4, dict(zero_stage=3, tp=2, sp=True, cp=2, **SP_NORMS)),
}


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", PLANS)
def test_pytorch_ring_attention_issues_what_the_schedule_says_and_trains_alike(name, tmp_path):
    world, plan = PLANS[name]
    job = build_job(tiny(), cluster(gpus=world), ParallelPlan(**plan))
    res = conform(job, tmp_path / "run", steps=3, timeout_s=150, log=lambda m: None)
    assert res["differences"] == [], json.dumps(res["differences"], indent=1)
    lo = res["losses"]
    assert lo["match"] and max(lo["relative_error"]) <= 1e-5, lo
    names, dp_cp = set(), job.parallel.dp * job.parallel.cp
    for rows in res["ranks"].values():  # every rank moved what the schedule says
        assert rows and all(r["ir_count"] == r["torch_count"] and r["ir_bytes"] == r["torch_bytes"]
                            for r in rows)
        names |= {(r["group_name"], r["kind"]) for r in rows}
        # the gradients reduced over dp x cp (named cp when dp=1: the same ranks)
        assert any(len(r["group"]) == dp_cp and r["kind"] in ("all_reduce", "reduce_scatter")
                   for r in rows)
    assert {("cp", "send"), ("cp", "recv")} <= names


@pytest.mark.parametrize("plan", [dict(cp=2, cp_method="allgather"), dict(cp=2, pp=2)])
def test_other_cp_plans_are_refused_in_one_line(plan):
    job = build_job(tiny(), cluster(gpus=4 if plan.get("pp") else 2),
                    ParallelPlan(global_batch_size=8, **plan))
    with pytest.raises(ConfigError, match=r"conformance runs CP as a plain-PyTorch ring"):
        check_plan(job)
