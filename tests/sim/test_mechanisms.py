"""The cost model's mechanisms of real steps, each against its closed form: the host that
issues ops in program order, GEMM tile and wave quantization, and per-shape kernel factors."""

from __future__ import annotations

import dataclasses

import pytest

from tests.conftest import gpt
from twin.cost import CostModel, KernelCost, LinkCost
from twin.kernelshape import gemm_utilization, shape_key
from twin.schedule.ir import Op, Program
from twin.sim.engine import SimOptions, Simulation
from twin.spec import ClusterSpec, GPUSpec, ParallelPlan, build_job

PEAK = 100e12  # FLOP/s


def _job(sm_count=None):
    cl = ClusterSpec(name="ideal", num_nodes=1, gpus_per_node=1,
                     gpu=GPUSpec(name="g", peak_tflops={"bf16": PEAK / 1e12}, hbm_GB=80,
                                 hbm_bw_GBps=1e6, sm_count=sm_count))
    return build_job(gpt(), cl, ParallelPlan(global_batch_size=1))


def _cost(gemm_host_us=0.0, elem_host_us=0.0, tile=0):
    return CostModel(base_latency_us=0.0, intra=LinkCost(bw_efficiency=1.0),
                     gemm=KernelCost(efficiency=1.0, launch_us=0.0, host_us=gemm_host_us, tile=tile),
                     elementwise=KernelCost(efficiency=1.0, mem_efficiency=1.0, launch_us=0.0,
                                            host_us=elem_host_us))


def _gemm(name, seconds, deps=()):
    return Op(name=name, kind="gemm", stream="compute", flops=seconds * PEAK, deps=deps,
              shape=(4096, 4096, 4096))


def _run(ops, cost, job=None):
    job = job or _job()
    sim = Simulation(job, {0: Program(0, ops)}, cost, SimOptions(), {0: [0]})
    return sim.run(), sim


def test_host_issue_is_a_max_plus_recursion():
    """C_i = max(C_{i-1}, H_i) + d_i with H_i the host's cumulative issue time."""
    d = [5e-3, 1e-3, 1e-3]
    ops = [_gemm("a", d[0]), _gemm("b", d[1], (0,)),
           Op(name="c", kind="elementwise", stream="compute", bytes=d[2] * 1e6 * 1e9,
              deps=(1,))]
    cost = _cost(gemm_host_us=1e3, elem_host_us=8e3)  # h = 1, 1, then 8 ms: H = 1, 2, 10
    t, sim = _run(ops, cost)
    H = [1e-3, 2e-3, 10e-3]
    c1 = H[0] + d[0]
    c2 = max(c1, H[1]) + d[1]
    c3 = max(c2, H[2]) + d[2]
    assert t == pytest.approx(c3, rel=1e-9)
    assert sim.structure_of(0).host.issue_s == pytest.approx(H)


def test_without_host_costs_the_step_is_the_device_chain():
    ops = [_gemm("a", 2e-3), _gemm("b", 3e-3, (0,))]
    t, _ = _run(ops, _cost())
    assert t == pytest.approx(5e-3, rel=1e-9)


def test_many_small_ops_are_host_bound():
    n, host_us, dev = 200, 30.0, 2e-6
    ops = [_gemm(f"g{i}", dev, (i - 1,) if i else ()) for i in range(n)]
    t, _ = _run(ops, _cost(gemm_host_us=host_us))
    assert t == pytest.approx(n * host_us * 1e-6 + dev, rel=1e-9)


@pytest.mark.parametrize("m, n, tile, sms, want", [
    (128, 128, 128, 108, 1 / 108),                       # one tile on 108 SMs
    (1024, 384, 128, 108, 24 / 108),                     # 8 x 3 tiles, one wave
    (1000, 1000, 128, None, 1e6 / (64 * 128 * 128)),     # padding only
    (1000, 1000, 128, 108, 1e6 / (64 * 128 * 128) * 64 / 108),
    (128 * 12, 128 * 12, 128, 108, 144 / (2 * 108)),     # 144 tiles: two waves, the second 36
])
def test_gemm_utilization_closed_form(m, n, tile, sms, want):
    assert gemm_utilization(m, n, tile, sms) == pytest.approx(want, rel=1e-12)


def test_gemm_time_divides_by_the_utilization():
    job = _job(sm_count=108)
    op = Op(name="g", kind="gemm", stream="compute", flops=2.0 * 1024 * 384 * 1024,
            shape=(1024, 384, 1024), dtype="bf16")
    flat = _cost().compute_time(op, job.cluster.gpu)
    tiled = _cost(tile=128).compute_time(op, job.cluster.gpu)
    assert flat == pytest.approx(op.flops / PEAK)
    assert tiled == pytest.approx(flat * 108 / 24)
    # a CPU or unknown GPU (no sm_count): padding only
    cpu = dataclasses.replace(job.cluster.gpu, sm_count=None)
    assert _cost(tile=128).compute_time(op, cpu) == pytest.approx(flat)


def _two_ranks():
    cl = ClusterSpec(name="ideal2", num_nodes=1, gpus_per_node=2,
                     gpu=GPUSpec(name="g", peak_tflops={"bf16": PEAK / 1e12}, hbm_GB=80,
                                 hbm_bw_GBps=1e6))
    return build_job(gpt(), cl, ParallelPlan(dp=2, global_batch_size=2))


@pytest.mark.parametrize("sync", [False, True])
def test_the_host_waits_for_a_send_recv_batch_when_it_synchronizes(sync):
    """Megatron's batch_isend_irecv + cuda.synchronize(): an op issued after the batch
    starts no earlier than the batch (and the work before it) has finished, plus the host's
    time from the batch to that op: max(H_b, T_sync + H_b - H_send)."""
    job = _two_ranks()
    h = 100.0  # us per op, on the host
    cost = dataclasses.replace(_cost(gemm_host_us=h), host_comm_us=h, p2p_latency_us=0.0,
                               p2p_host_sync=sync)
    r0 = [_gemm("a", 1e-3), Op(name="s", kind="send", stream="p2p", peer=1, tag="x",
                               bytes=2e8, deps=(0,)), _gemm("b", 1e-3)]
    r1 = [Op(name="r", kind="recv", stream="p2p", peer=0, tag="x", bytes=2e8)]
    sim = Simulation(job, {0: Program(0, r0), 1: Program(1, r1)}, cost, SimOptions(),
                     {0: [0], 1: [1]})
    sim.run()
    send_end, b_start = float(sim.end[0][1]), float(sim.start[0][2])
    assert send_end > 1e-3
    if sync:
        assert b_start == pytest.approx(send_end + h * 1e-6, rel=1e-9)
    else:
        # right after a (issued at 0.1 ms, 1 ms long), long before the send ends
        assert b_start == pytest.approx(float(sim.end[0][0]), rel=1e-9) == pytest.approx(1.1e-3)


def test_a_collectives_host_time_grows_with_its_group():
    cost = dataclasses.replace(_cost(), host_comm_us=10.0, host_comm_per_rank_us=3.0)
    ar = Op(name="ar", kind="all_reduce", stream="comm", group=tuple(range(8)), bytes=1.0)
    send = Op(name="s", kind="send", stream="p2p", peer=1, tag="x", bytes=1.0)
    assert cost.host_time(ar) == pytest.approx((10.0 + 3.0 * 8) * 1e-6)
    assert cost.host_time(send) == pytest.approx(10.0e-6)


def test_a_shape_factor_scales_that_shape_only_and_not_its_launch():
    """t = factor * roofline + launch for the listed shape; other shapes and kinds unchanged."""
    gpu = _job().cluster.gpu
    base = dataclasses.replace(_cost(), gemm=KernelCost(efficiency=0.5, launch_us=7.0))
    op = _gemm("g", 1e-3)
    other = dataclasses.replace(op, shape=(4096, 4096, 2048))
    assert shape_key(op) == "gemm:bf16:4096x4096x4096"
    shaped = dataclasses.replace(base, shape_factors={shape_key(op): 1.3})
    roof = base.compute_time(op, gpu) - 7e-6
    assert roof == pytest.approx(2e-3)
    assert shaped.compute_time(op, gpu) == pytest.approx(1.3 * roof + 7e-6)
    assert shaped.compute_time(other, gpu) == base.compute_time(other, gpu)
    elem = Op(name="e", kind="elementwise", stream="compute", bytes=1e6, shape=(4096, 4096, 4096))
    assert shaped.compute_time(elem, gpu) == base.compute_time(elem, gpu)


def test_the_summary_says_what_shape_factors_add_to_the_critical_path():
    """One GPU, one stream: slowing every GEMM shape by 1.5x lengthens the step by exactly
    what critical_path_shape_factors_s reports (half the GEMMs' roofline time)."""
    from twin.schedule.builder import build_schedule
    from twin.sim.run import simulate

    job = _job()
    cost = _cost()
    ops = build_schedule(job).program(0).ops
    shapes = {shape_key(op) for op in ops if op.kind == "gemm"}
    gemm_s = sum(cost.compute_time(op, job.cluster.gpu) for op in ops if op.kind == "gemm")
    plain = simulate(job, cost, SimOptions()).summary
    shaped = simulate(job, dataclasses.replace(cost, shape_factors={k: 1.5 for k in shapes}),
                      SimOptions()).summary
    assert plain["critical_path_shape_factors_s"] == 0.0
    assert shaped["critical_path_shape_factors_s"] == pytest.approx(0.5 * gemm_s, rel=1e-9)
    assert shaped["step_time_s"] - plain["step_time_s"] == pytest.approx(0.5 * gemm_s, rel=1e-6)
