"""The twin against closed forms, its own invariants, and determinism."""

from __future__ import annotations

import dataclasses
import json

import pytest
import simpy

from tests.conftest import cluster, gpt
from twin.cost import CostModel, KernelCost, LinkCost, ring_allreduce_time, tree_allreduce_time
from twin.schedule.ir import Op, Program
from twin.sim.engine import SimOptions, Simulation, fold_classes
from twin.sim.fabric import Fabric
from twin.sim.records import Events, ended, fire_op
from twin.sim.run import simulate
from twin.spec import (
    ClusterSpec,
    ConfigWarning,
    GPUSpec,
    InterNodeSpec,
    IntraNodeSpec,
    ParallelPlan,
    build_job,
)

FREE = CostModel(name="free-comm", base_latency_us=0.0, p2p_latency_us=0.0,
                 intra=LinkCost(bw_efficiency=1.0, latency_us=0.0),
                 inter=LinkCost(bw_efficiency=1.0, latency_us=0.0),
                 gemm=KernelCost(efficiency=0.5, launch_us=0.0),
                 attention=KernelCost(efficiency=0.5, launch_us=0.0),
                 elementwise=KernelCost(mem_efficiency=1.0, launch_us=0.0),
                 optimizer=KernelCost(mem_efficiency=1.0, launch_us=0.0))


def _fast_cluster(gpus=8, nodes=1, bw=1e9, lat=0.0):
    return ClusterSpec(name="ideal", num_nodes=nodes, gpus_per_node=gpus,
                       gpu=GPUSpec(name="g", peak_tflops={"bf16": 100.0}, hbm_GB=80,
                                   hbm_bw_GBps=1e6),
                       intra=IntraNodeSpec(bw_GBps=bw, latency_us=lat),
                       inter=InterNodeSpec(nic_bw_GBps=bw, latency_us=lat))


def _one_collective(kind, n, nbytes, cl, algorithm="ring", cost=None):
    job = build_job(gpt(), cl, ParallelPlan(dp=cl.world_size, global_batch_size=cl.world_size))
    group = tuple(range(n))
    progs = {r: Program(r, [Op(name="c", kind=kind, stream="comm", group=group, bytes=nbytes,
                               group_name="dp")]) for r in group}
    cost = cost or CostModel(base_latency_us=0.0, intra=LinkCost(bw_efficiency=1.0),
                             inter=LinkCost(bw_efficiency=1.0))
    sim = Simulation(job, progs, cost, SimOptions(algorithm=algorithm),
                     {r: [r] for r in range(cl.world_size)})
    return sim.run()


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("nbytes", [1e6, 256e6])
def test_uncontended_ring_all_reduce_is_the_closed_form(n, nbytes):
    cl = _fast_cluster(gpus=8, bw=100.0, lat=5.0)
    t = _one_collective("all_reduce", n, nbytes, cl)
    assert t == pytest.approx(ring_allreduce_time(nbytes, n, 100e9, 5e-6), rel=1e-9)


def test_uncontended_tree_all_reduce_is_the_closed_form():
    cl = _fast_cluster(gpus=8, bw=100.0, lat=5.0)
    t = _one_collective("all_reduce", 8, 64e6, cl, algorithm="tree")
    assert t == pytest.approx(tree_allreduce_time(64e6, 8, 100e9, 5e-6), rel=1e-9)


@pytest.mark.parametrize("kind", ["all_gather", "reduce_scatter"])
def test_ring_gather_and_scatter_move_n_minus_1_over_n(kind):
    cl = _fast_cluster(gpus=8, bw=100.0, lat=0.0)
    assert _one_collective(kind, 8, 80e6, cl) == pytest.approx(7 / 8 * 80e6 / 100e9, rel=1e-9)


def test_two_transfers_sharing_a_link_each_take_twice_as_long():
    env = simpy.Environment()
    fab = Fabric(env, {"link": 10.0})
    ends = {}

    def go(name):
        yield fab.transfer(("link",), 50.0)
        ends[name] = env.now

    env.process(go("alone"))
    env.run()
    env2 = simpy.Environment()
    fab2 = Fabric(env2, {"link": 10.0})

    def go2(name):
        yield fab2.transfer(("link",), 50.0)
        ends[name] = env2.now

    env2.process(go2("a"))
    env2.process(go2("b"))
    env2.run()
    assert ends["alone"] == pytest.approx(5.0)
    assert ends["a"] == ends["b"] == pytest.approx(10.0)


def test_a_flow_given_then_calls_it_when_it_has_moved_and_no_event_fires():
    """Fabric.transfer(then=...): the callback runs at the flow's end, after the fabric has
    re-rated the flows left (the 30-unit flow speeds up once the 10-unit one is done: 10 at
    half the link, then 20 alone, 2 + 2 = 4 s); nothing to move returns False."""
    env = simpy.Environment()
    fab = Fabric(env, {"link": 10.0})
    ends, rates = {}, {}

    def then(name, other=None):
        def called():
            ends[name] = env.now
            if other is not None:
                rates[other] = next(iter(fab.flows_on["link"])).rate  # re-rated already
        return called

    assert fab.transfer(("link",), 10.0, then=then("short", "long")) is True
    assert fab.transfer(("link",), 30.0, then=then("long")) is True
    assert fab.transfer(("link",), 0.0, then=then("empty")) is False
    env.run()
    assert ends == {"short": pytest.approx(2.0), "long": pytest.approx(4.0)}
    assert rates == {"long": 10.0}


def test_an_op_that_ends_before_anyone_waits_gets_no_event_of_its_own():
    """records.Events: fire_op records an op nobody waits for as done (the one processed
    event), which a later waiter finds done; an op waited for gets its own event, fired."""
    env = simpy.Environment()
    evs = Events(None, ended(env))
    fire_op(evs, 3)
    assert evs[3] is evs.done and evs[3].processed and evs[3].triggered
    ev = evs[4] = env.event()
    hits = []
    ev.callbacks.append(lambda _e: hits.append(env.now))
    env.timeout(2.0).callbacks.append(lambda _e: fire_op(evs, 4))
    env.run()
    assert hits == [2.0] and evs[4] is ev and ev.processed


def test_dp_all_reduce_on_a_nic_slows_a_pp_send_on_the_same_nic():
    # two nodes, one NIC each: a big all-reduce between the nodes shares the NIC with a send
    cl = ClusterSpec(name="2n", num_nodes=2, gpus_per_node=2,
                     gpu=GPUSpec(peak_tflops={"bf16": 100.0}),
                     inter=InterNodeSpec(nics_per_node=1, nic_bw_GBps=10.0, latency_us=0.0))
    job = build_job(gpt(), cl, ParallelPlan(dp=4, global_batch_size=4))
    cost = CostModel(base_latency_us=0.0, p2p_latency_us=0.0, inter=LinkCost(bw_efficiency=1.0))

    def send_time(with_ar: bool) -> float:
        progs = {0: Program(0, [Op(name="s", kind="send", stream="p2p", peer=2, tag="x", bytes=1e8)]),
                 2: Program(2, [Op(name="r", kind="recv", stream="p2p", peer=0, tag="x", bytes=1e8)])}
        if with_ar:
            for r in (1, 3):
                progs[r] = Program(r, [Op(name="ar", kind="all_reduce", stream="comm", group=(1, 3),
                                          bytes=4e9, group_name="dp")])
        sim = Simulation(job, progs, cost, SimOptions(), {r: [r] for r in range(4)})
        sim.run()
        return float(sim.end[0][0])

    alone, shared = send_time(False), send_time(True)
    assert alone == pytest.approx(1e8 / 10e9)
    assert shared == pytest.approx(2 * alone, rel=1e-6)


def _pipeline_job(schedule, p=4, m=8):
    model = gpt(num_layers=8, vocab_size=8, hidden_size=512, num_heads=8, num_kv_heads=8,
                ffn_hidden_size=2048)
    return build_job(model, _fast_cluster(gpus=p), ParallelPlan(pp=p, pp_schedule=schedule,
                                                                 global_batch_size=m))


def test_gpipe_bubble_is_p_minus_1_over_m_plus_p_minus_1():
    s = simulate(_pipeline_job("gpipe"), FREE).summary
    assert s["bubble_fraction"] == pytest.approx(3 / 11, rel=0.02)


def test_1f1b_with_fewer_microbatches_than_stages_has_the_fill_drain_bubble():
    """Megatron's 1F1B with m < p (issue 13's refused A100 row): (p - 1) / (m + p - 1)."""
    with pytest.warns(ConfigWarning, match="degenerates to fill/drain"):
        job = _pipeline_job("1f1b", p=4, m=2)
    s = simulate(job, FREE).summary
    assert s["bubble_fraction"] == pytest.approx(3 / 5, rel=0.02)


def test_1f1b_takes_gpipes_time_with_fewer_microbatches_in_flight():
    g = simulate(_pipeline_job("gpipe"), FREE).summary
    f = simulate(_pipeline_job("1f1b"), FREE).summary
    assert f["step_time_s"] == pytest.approx(g["step_time_s"], rel=1e-6)
    assert f["peak_memory_bytes"]["0"] < g["peak_memory_bytes"]["0"]


def test_ddp_exposed_communication_is_at_most_its_total():
    job = build_job(gpt(num_layers=8, hidden_size=1024, num_heads=8, num_kv_heads=8,
                        ffn_hidden_size=4096, seq_len=1024), cluster(), ParallelPlan(global_batch_size=8))
    res = simulate(job)
    spans = [s for s in res.trace.spans if s.rank == 0 and s.group == "dp"]
    total = sum(s.dur_us for s in spans) / 1e6
    assert 0 < res.summary["exposed_comm_s"]["dp"] <= total + 1e-12
    assert res.summary["exposed_comm_s"]["dp"] < 0.9 * total  # buckets overlap backward


def test_same_config_and_seed_give_a_byte_identical_trace(tmp_path):
    job = build_job(gpt(), cluster(gpus=4), ParallelPlan(tp=2, pp=2, sp=True, global_batch_size=4))
    cost = dataclasses.replace(FREE, compute_cv=0.1, comm_cv=0.2)
    a = simulate(job, cost, SimOptions(jitter=True, seed=7), steps=3)
    b = simulate(job, cost, SimOptions(jitter=True, seed=7), steps=3)
    c = simulate(job, cost, SimOptions(jitter=True, seed=8), steps=3)
    a.trace.save(tmp_path / "a.json")
    b.trace.save(tmp_path / "b.json")
    c.trace.save(tmp_path / "c.json")
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()
    assert (tmp_path / "a.json").read_bytes() != (tmp_path / "c.json").read_bytes()
    s = a.summary
    assert s["steps"] == 3 and s["step_time_p10_s"] <= s["step_time_p50_s"] <= s["step_time_p90_s"]
    assert s["step_time_p10_s"] < s["step_time_p90_s"]


@pytest.mark.parametrize("plan, fold", [
    (dict(tp=2, pp=2, sp=True, global_batch_size=8), "all"),
    (dict(zero_stage=3, global_batch_size=8), "dp"),
    (dict(tp=4, global_batch_size=2), "tp"),
    (dict(tp=2, pp=2, global_batch_size=4, zero_stage=1), "dp"),
])
def test_folded_and_full_runs_agree(plan, fold):
    cl = ClusterSpec(name="2n", num_nodes=2, gpus_per_node=4, gpu=GPUSpec(peak_tflops={"bf16": 300.0}),
                     inter=InterNodeSpec(nics_per_node=4, nic_bw_GBps=25.0))
    job = build_job(gpt(), cl, ParallelPlan(**plan))
    full = simulate(job, options=SimOptions(fold="none")).summary
    folded = simulate(job, options=SimOptions(fold=fold)).summary
    assert folded["simulated_ranks"] < full["simulated_ranks"] == 8
    assert folded["step_time_s"] == pytest.approx(full["step_time_s"], rel=1e-9)


def test_fold_classes_cover_the_world_once():
    job = build_job(gpt(), cluster(), ParallelPlan(tp=2, pp=2, global_batch_size=4))
    classes = fold_classes(job, "all")
    assert sorted(r for ms in classes.values() for r in ms) == list(range(8))
    assert len(classes) == 2  # one per pipeline stage
    with pytest.raises(ValueError, match="cannot fold legacy DP"):
        fold_classes(build_job(gpt(), cluster(), ParallelPlan(legacy_dp=True)), "dp")


def test_straggler_and_degraded_link_slow_the_step():
    job = build_job(gpt(hidden_size=1024, num_heads=8, num_kv_heads=8, ffn_hidden_size=4096),
                    ClusterSpec(name="2n", num_nodes=2, gpus_per_node=4,
                                gpu=GPUSpec(peak_tflops={"bf16": 300.0})),
                    ParallelPlan(global_batch_size=8))
    base = simulate(job).summary["step_time_s"]
    slow = simulate(job, options=SimOptions(straggler={5: 2.0})).summary["step_time_s"]
    link = simulate(job, options=SimOptions(degraded={("nic_out", 0, 0): 0.01})).summary["step_time_s"]
    assert slow > 1.3 * base and link > base


def test_summary_has_the_public_fields():
    s = simulate(build_job(gpt(), cluster(gpus=2), ParallelPlan(pp=2, global_batch_size=4))).summary
    for key in ("step_time_s", "tokens_per_s", "tflops_per_gpu", "mfu", "bubble_fraction",
                "exposed_comm_s", "compute_s", "idle_s", "peak_memory_bytes", "fits_memory",
                "world_size", "simulated_ranks", "events", "wall_s"):
        assert key in s
    json.dumps(s.to_dict())  # summary.json: plain JSON
