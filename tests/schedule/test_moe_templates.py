"""A MoE rank's translated program is the program built for it (cases a differential fuzz of
fold=auto against fold=none found: async TP's send/recv ring under an EP digit shift, and
etp = tp with dp innermost, whose expert groups were not the TP groups)."""

from __future__ import annotations

import warnings

import pytest

from tests.conftest import cluster
from tests.schedule.test_moe_schedule import moe_model
from twin.schedule.builder import build_program, build_schedule
from twin.sim.engine import SimOptions
from twin.sim.run import simulate
from twin.spec import ParallelPlan, build_job
from twin.spec.experts import expert_grid


def _wiring(program):
    return [(op.name, op.group, op.peer, op.root, op.bytes) for op in program.ops]


PLANS = {
    "async tp4 ep2 etp1": (8, dict(tp=4, sp=True, async_tp=True, compile=True, ep=2, etp=1,
                                   global_batch_size=2)),
    "etp=tp2 ep1 dp3, dp innermost": (6, dict(tp=2, sp=True, ep=1, etp=2, global_batch_size=3,
                                              rank_order="dp-tp-cp-pp")),
    "tp2 etp1 ep2 dp2, dp innermost": (4, dict(tp=2, sp=True, ep=2, etp=1, global_batch_size=2,
                                               rank_order="dp-tp-cp-pp")),
    "async tp2 ep2 dp2, tp outermost": (8, dict(tp=2, sp=True, async_tp=True, compile=True,
                                                ep=4, etp=1, pp=1, global_batch_size=4,
                                                rank_order="dp-cp-pp-tp")),
}


@pytest.mark.parametrize("name", PLANS)
def test_translated_programs_are_the_built_ones(name):
    gpus, plan = PLANS[name]
    job = build_job(moe_model(), cluster(gpus=gpus), ParallelPlan(**plan))
    schedule = build_schedule(job)
    for rank in range(gpus):
        assert _wiring(schedule.program(rank)) == _wiring(build_program(job, rank)), rank


@pytest.mark.parametrize("order", ["tp-cp-pp-dp", "dp-tp-cp-pp", "pp-dp-cp-tp"])
def test_etp_equal_to_tp_is_the_tp_group_under_any_rank_order(order):
    job = build_job(moe_model(), cluster(gpus=8),
                    ParallelPlan(tp=2, sp=True, pp=2, etp=2, rank_order=order,
                                 global_batch_size=4))
    eg = expert_grid(job.grid, job.parallel)
    for rank in range(8):
        assert eg.group(rank, "etp") == job.grid.group(rank, "tp")
        assert eg.group(rank, "edp") == job.grid.group(rank, "dp")
        assert eg.group(rank, "ep") == (rank,)
        assert eg.coords(rank) == {"etp": job.grid.coord(rank, "tp"), "ep": 0,
                                   "edp": job.grid.coord(rank, "dp")}


def test_dense_experts_read_as_the_general_rule_in_tp_innermost_orders():
    # the stage read in rank order with etp innermost gives the TP groups when tp is inside dp
    job = build_job(moe_model(), cluster(gpus=8),
                    ParallelPlan(tp=2, sp=True, pp=2, etp=2, global_batch_size=4))
    eg = expert_grid(job.grid, job.parallel)
    for rank in range(8):
        stage = job.grid.group(rank, ("tp", "cp", "dp"))
        i = stage.index(rank)
        assert eg.group(rank, "etp") == tuple(stage[i - i % 2 + j] for j in range(2))
        assert eg.group(rank, "edp") == tuple(stage[i % 2 + 2 * j] for j in range(2))


@pytest.mark.parametrize("name", PLANS)
def test_folded_step_is_the_full_one(name):
    gpus, plan = PLANS[name]
    job = build_job(moe_model(), cluster(gpus=gpus), ParallelPlan(**plan))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        full, folded = (simulate(job, None, SimOptions(fold=f), trace="none").summary
                        for f in ("none", "auto"))
    assert folded["step_time_s"] == pytest.approx(full["step_time_s"], rel=1e-12)
