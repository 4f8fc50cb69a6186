"""Private calls timed by arithmetic (twin/sim/private.py) change no time: with them the
engine gives every op the start and end it gets with every call run through the fabric; a
call that meets another flow on its links has the step simulated again in the fabric."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from tests.conftest import cluster, gpt
from twin.cost import CostModel, KernelCost, default_cost_model
from twin.schedule.builder import build_schedule
from twin.sim.engine import SimOptions, Simulation, fold_classes
from twin.sim.private import PrivateCall
from twin.spec import ParallelPlan, build_job

SYNC = CostModel(name="host-sync", p2p_host_sync=True, p2p_latency_us=20.0,
                 gemm=KernelCost(efficiency=0.5, host_us=10.0),
                 elementwise=KernelCost(mem_efficiency=0.5, host_us=10.0))
"""A host that waits after every send/recv batch (Megatron's), as the A100 profile's."""


def _job(plan: dict, nodes: int = 2, gpus: int = 8, **model):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return build_job(gpt(**{"num_layers": 8, **model}), cluster(nodes, gpus),
                         ParallelPlan(**plan))


def _run(job, cost, inline: bool, fold: str = "all") -> Simulation:
    classes = fold_classes(job, fold)
    programs = build_schedule(job).programs(sorted(classes))
    sim = Simulation(job, programs, cost or default_cost_model(job.cluster),
                     SimOptions(fold=fold), classes)
    sim.inline_private = inline
    sim.run()
    return sim


def _same_times(a: Simulation, b: Simulation) -> None:
    step = max(float(e.max()) for e in b.end.values())
    for r in b.programs:
        assert np.abs(a.start[r] - b.start[r]).max() <= 1e-9 * step, r
        assert np.abs(a.end[r] - b.end[r]).max() <= 1e-9 * step, r


# TP inside a node, folded: each TP all-reduce has one simulated member and its links only
# its own TP stream crosses (the clipping norm's all-reduce crosses them too, at step end)
PLANS = {
    "interleaved, tp8, host waits for each batch": (
        dict(tp=8, pp=2, pp_schedule="interleaved", pp_virtual_stages=2,
             global_batch_size=16), SYNC),
    "1f1b, tp8 x dp2, full recompute": (
        dict(tp=8, pp=2, recompute="full", global_batch_size=32), None),
    "tp4 + sp, pp2, zero1": (dict(tp=4, sp=True, pp=2, zero_stage=1, global_batch_size=32),
                             SYNC),
}


@pytest.mark.parametrize("name", PLANS)
def test_private_calls_end_when_the_fabric_would_end_them(name):
    plan, cost = PLANS[name]
    job = _job(plan, nodes=4 if plan.get("tp") == 8 else 2)
    fast, ref = _run(job, cost, True), _run(job, cost, False)
    assert fast.inline_private and any(inlined for _, inlined in fast._walks)  # no rerun
    assert fast.events < ref.events
    _same_times(fast, ref)
    full = _run(job, cost, True, fold="none")  # TP unfolded: every call in the fabric
    step = max(float(e.max()) for e in full.end.values())
    assert max(float(e.max()) for e in fast.end.values()) == pytest.approx(step, rel=1e-9)


def test_a_private_call_that_meets_another_flow_is_simulated_again_in_the_fabric():
    # tp2 x pp2 x dp2 in one node: DDP's 25 MB gradient buckets (comm stream) cross the
    # NVSwitch port of stage 0's TP all-reduces (comm.tp stream, private but for them) while
    # its backward runs; timed alone, those all-reduces would end ~1 us early
    job = _job(dict(tp=2, pp=2, global_batch_size=8), nodes=1, hidden_size=1024,
               ffn_hidden_size=4096)
    fast, ref = _run(job, None, True), _run(job, None, False)
    assert not fast.inline_private  # Contended: simulated again with every call in the fabric
    _same_times(fast, ref)


def test_a_call_lasts_its_latencies_plus_its_bytes_at_its_rate_alone():
    call = PrivateCall((0, "comm.tp"), 5e-6, ((1e-6, 2.0, 1e9), (0.0, 0.0, 0.0),
                                               (2e-6, 1.0, 4e9)))
    assert call.end_s(3.0, 1e6) == pytest.approx(3.0 + 5e-6 + 1e-6 + 2e6 / 1e9 + 2e-6 + 1e6 / 4e9)
    assert call.end_s(0.0, 0.0) == pytest.approx(8e-6)


def test_the_host_resumes_when_the_last_op_it_waited_for_ended():
    # Megatron 39.1B on 512 A100s (benchmarks/bench_twin.py (d)): interleaved 1F1B under the
    # A100 profile's host, which waits after every send/recv batch, with DDP buckets in
    # flight. Each sync point's resume time, kept once per sync point, is the latest end of
    # the ops it waits for as they end (a bucket's all-reduce is waited for until its stream
    # has recorded its end, not only until its event has fired)
    from benchmarks.bench_twin import job_of

    _, job, cost, _, _ = job_of("d")
    classes = fold_classes(job, "all")
    sim = Simulation(job, build_schedule(job).programs(sorted(classes)), cost,
                     SimOptions(fold="all"), classes)
    sim.run()
    checked = 0
    for rank, synced in sim._synced.items():
        host, end = sim.structure_of(rank).host, sim.end[rank]
        for s, t in synced.items():
            assert t == max(float(end[w]) for w in host.waits[s]), (rank, s)
            checked += 1
    assert checked > 100
