"""The twin's uneven all-to-all (MoE dispatch): its time is its most loaded link's, even
all-to-alls are unchanged, and a skewed expert-parallel step simulates deterministically."""

from __future__ import annotations

import pytest

from tests.conftest import cluster, gpt
from tests.sim.test_twin import _fast_cluster, _one_collective
from twin.cost import CostModel, LinkCost
from twin.schedule.ir import Op, Program
from twin.sim.engine import SimOptions, Simulation
from twin.sim.run import simulate
from twin.spec import ConfigError, ParallelPlan, build_job
from twin.spec.moe import MoESpec

BW = 100.0  # GB/s per GPU link, no latency


def _uneven(rows: dict[int, list[float]]) -> float:
    cl = _fast_cluster(gpus=4, bw=BW, lat=0.0)
    job = build_job(gpt(), cl, ParallelPlan(dp=4, global_batch_size=4))
    g = (0, 1, 2, 3)
    mean = sum(map(sum, rows.values())) / 4
    progs = {r: Program(r, [Op(name="a2a", kind="all_to_all", stream="comm", group=g,
                               bytes=mean, group_name="ep", send_splits=tuple(rows[r]),
                               recv_splits=tuple(rows[s][r] for s in g))]) for r in g}
    cost = CostModel(base_latency_us=0.0, intra=LinkCost(bw_efficiency=1.0),
                     inter=LinkCost(bw_efficiency=1.0))
    return Simulation(job, progs, cost, SimOptions(), {r: [r] for r in g}).run()


def test_even_all_to_all_is_the_closed_form():
    # each rank sends (n-1)/n of its S-byte buffer over its own link
    cl = _fast_cluster(gpus=4, bw=BW, lat=0.0)
    assert _one_collective("all_to_all", 4, 8e6, cl) == pytest.approx(0.75 * 8e6 / (BW * 1e9))


def test_uneven_all_to_all_lasts_as_long_as_its_busiest_link():
    # every source sends peer 2 six times what it sends 0 and 1, and 3 nothing: rank 2's
    # inbound link carries 3 x 6 MB (the busiest: rank 3's outbound carries 8 MB)
    row = [1e6, 1e6, 6e6, 0.0]
    t = _uneven({r: row for r in range(4)})
    assert t == pytest.approx(18e6 / (BW * 1e9))
    # the same matrix made even (2 MB to each peer) moves the same bytes 3x faster
    assert _uneven({r: [2e6] * 4 for r in range(4)}) == pytest.approx(6e6 / (BW * 1e9))



def test_opposite_uneven_all_to_alls_are_planned_apart():
    """Two uneven all-to-alls on one group, every token to peer 1, then every token to peer
    0: the same byte sizes, opposite links. Each keeps its own plan (the planner's memo was
    keyed on the sizes alone, and the second reused the first's links)."""
    cl = _fast_cluster(gpus=2, bw=BW, lat=0.0)
    job = build_job(gpt(), cl, ParallelPlan(dp=2, global_batch_size=2))
    g = (0, 1)
    rows = {"to1": {0: (0.0, 8e6), 1: (0.0, 0.0)}, "to0": {0: (0.0, 0.0), 1: (8e6, 0.0)}}
    progs = {r: Program(r, [Op(name=n, kind="all_to_all", stream="comm", group=g, bytes=4e6,
                               group_name="ep", send_splits=rows[n][r],
                               recv_splits=tuple(rows[n][s][r] for s in g), deps=deps)
                            for n, deps in (("to1", ()), ("to0", (0,)))]) for r in g}
    cost = CostModel(base_latency_us=0.0, intra=LinkCost(bw_efficiency=1.0),
                     inter=LinkCost(bw_efficiency=1.0))
    sim = Simulation(job, progs, cost, SimOptions(), {r: [r] for r in g})
    sim.run()
    flows = sim.flows
    plans = [flows._memo[flows._uneven[(g, n)]].bundles[0].resources for n in ("to1", "to0")]
    assert plans[0] != plans[1]
    assert any(r[0] == "out" and r[1] == 1 for r in plans[1])  # rank 1 sends the second

def _moe_job(skew: float):
    moe = MoESpec(num_experts=8, experts_per_token=2, moe_ffn_hidden_size=512,
                  routing="skewed" if skew else "uniform", routing_skew=skew)
    return build_job(gpt(num_layers=2, activation="swiglu", moe=moe), cluster(gpus=4),
                     ParallelPlan(ep=4))


def test_skewed_step_is_deterministic_and_slower_to_dispatch():
    skew = simulate(_moe_job(0.8), trace="full")
    again = simulate(_moe_job(0.8), trace="full")
    even = simulate(_moe_job(0.0), trace="full")
    assert skew.summary["step_time_s"] == again.summary["step_time_s"]
    assert skew.summary["simulated_ranks"] == 4  # fold=none, the default, simulates every rank

    def dispatch(res) -> float:
        return max(s.end_us - s.start_us for s in res.trace.spans
                   if s.op == "fwd/mb0/L0/moe.dispatch")

    assert dispatch(skew) > dispatch(even)


def test_folding_an_expert_parallel_plan_is_refused():
    with pytest.raises(ConfigError, match=r"fold=dp cannot fold a plan with expert parallelism"):
        simulate(_moe_job(0.5), options=SimOptions(fold="dp"))
