"""The fast estimate: its units are the schedule's ops, its collectives the twin's, and it
orders plans as the simulator does."""

from __future__ import annotations

import dataclasses

import pytest
from scipy.stats import spearmanr

from paratwin.config import preset_cluster
from tests.conftest import gpt
from twin.calibrate.predict import collective_time
from twin.cost import default_cost_model
from twin.schedule.step import build_program
from twin.search.check import agreement, simulate_candidate
from twin.search.estimate import Estimator, step_end_ops
from twin.search.run import evaluate
from twin.search.space import SearchSpace
from twin.spec import ParallelPlan, build_job

H100 = preset_cluster("dgx_h100")
MODEL = gpt(num_layers=8, hidden_size=512, num_heads=8, num_kv_heads=8, ffn_hidden_size=2048,
            seq_len=512, vocab_size=8000)


@pytest.mark.parametrize("plan", [
    ParallelPlan(tp=2, sp=True, zero_stage=3, recompute="full", global_batch_size=8),
    ParallelPlan(tp=4, pp=2, recompute="selective", global_batch_size=8, micro_batch_size=2),
    ParallelPlan(pp=4, pp_schedule="interleaved", pp_virtual_stages=2, zero_stage=1,
                 global_batch_size=16),
])
def test_units_are_the_schedules_compute(plan):
    """Every compute op of a rank's program is one of the units the estimate times (m times
    over the stage's layers, its embedding or head) or the step end's."""
    job = build_job(MODEL, H100, plan)
    cost = default_cost_model(H100)
    est = Estimator(cost)
    u, shape, gpu = est.units(job), est.shape(job), H100.gpu
    par = job.parallel
    for stage in (0, par.pp - 1):
        program = build_program(job, job.grid.rank(pp=stage))
        simulated = sum(cost.compute_time(op, gpu) for op in program.ops if op.is_compute)
        units = shape.layers[stage] * (u["layer_fwd"].compute_s + u["layer_bwd"].compute_s)
        if stage == 0:
            units += u["embed_fwd"].compute_s + u["embed_bwd"].compute_s
        if stage == par.pp - 1:
            units += u["head_fwd"].compute_s + u["head_bwd"].compute_s
        local = shape.params[stage] if par.zero_stage == 0 else -(-shape.params[stage] // par.dp)
        end = sum(cost.compute_time(op, gpu) for op in step_end_ops(job, local))
        assert simulated == pytest.approx(par.num_microbatches * units + end, rel=1e-9)


@pytest.mark.parametrize("kind", ["all_reduce", "all_gather", "reduce_scatter"])
@pytest.mark.parametrize("nodes", [1, 2])
def test_collective_closed_form_is_the_twins_collective_alone(kind, nodes):
    """A ring inside a node, hierarchical across two: the closed form is the time the twin
    simulates for the same collective on the same links."""
    cl = dataclasses.replace(H100, num_nodes=nodes)
    cost = default_cost_model(cl)
    job = build_job(MODEL, cl, ParallelPlan(tp=1))
    est = Estimator(cost)
    for nbytes in (1e6, 3e8):
        twin = collective_time(kind, 8 * nodes, nbytes, cl, cost)
        assert est.comm.collective_s(job, kind, "dp", nbytes) == pytest.approx(twin, rel=1e-6)


@pytest.mark.filterwarnings("ignore")
def test_estimate_orders_plans_as_the_simulator_does():
    """On a sample spread over the plans that fit (16 H100s), the estimate ranks them as the
    full twin does (Spearman) and sizes them within a few percent."""
    cl = dataclasses.replace(H100, num_nodes=2)
    cost = default_cost_model(cl)
    space = SearchSpace(gpus=(16,), global_batch_size=32, micro_batch_size=(1, 4),
                        rank_order=("tp-cp-pp-dp", "dp-cp-pp-tp"))
    ev = evaluate(MODEL, cl, space, cost)
    cands = ev.candidates
    sample = cands[:: max(1, len(cands) // 12)][:12]
    est = [c.step_time_s for c in sample]
    sim = [simulate_candidate(MODEL, cl, c, cost).summary.step_time_s for c in sample]
    assert spearmanr(est, sim).statistic >= 0.8
    check = agreement(est, sim)
    assert check["median_abs_error"] < 0.10 and check["plans"] == len(sample)


def test_agreement_figures():
    check = agreement([1.0, 2.0, 3.0], [1.1, 1.9, 3.3])
    assert check["spearman"] == pytest.approx(1.0)
    assert check["regret"] == 0.0
    assert check["max_abs_error"] == pytest.approx(0.1 / 1.1, rel=1e-9)
    assert agreement([2.0, 1.0], [1.0, 2.0])["regret"] == pytest.approx(1.0)
