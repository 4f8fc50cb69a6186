"""Compute slowed beside NCCL kernels (CostModel.overlap_slowdown, twin/sim/overlap.py): an op
progresses at 1 / (1 + s) while a collective of its rank is in flight, so it pays s times
the share of its work that overlapped the call, no more and no less."""

from __future__ import annotations

import dataclasses

import pytest

from paratwin.config import CONF_DIR, preset_cluster
from tests.conftest import gpt
from tests.sim.test_mechanisms import _cost, _gemm, _two_ranks
from twin.cost import CostModel, LinkCost
from twin.schedule.ir import Op, Program
from twin.sim.engine import SimOptions, Simulation
from twin.sim.overlap import advance, overlapped_end
from twin.sim.run import simulate
from twin.spec import ParallelPlan, build_job

S = 0.25


def closed_form(start: float, c: float, a: float, b: float, s: float) -> float:
    """``c`` seconds of compute from ``start`` beside a call over [a, b], by cases."""
    a, b = max(a, start), max(b, start)
    if s <= 0 or start + c <= a:
        return start + c
    done = a - start  # work before the call
    if done + (b - a) / (1 + s) >= c:
        return a + (c - done) * (1 + s)
    return b + c - done - (b - a) / (1 + s)


@pytest.mark.parametrize("end", [overlapped_end, closed_form])
def test_the_closed_form(end):
    c, s = 4.0, 1.0  # rate 1/2 beside the call
    assert end(0.0, c, 5.0, 9.0, s) == c  # done before the call
    assert end(0.0, c, 1.0, 9.0, s) == 1.0 + 3.0 * 2  # ends beside it
    assert end(0.0, c, 1.0, 3.0, s) == 3.0 + 4.0 - 1.0 - 1.0  # a call inside it
    assert end(2.0, c, 0.0, 4.0, s) == 4.0 + 4.0 - 1.0  # started beside it
    assert end(0.0, c, 1.0, 3.0, 0.0) == c


def test_advance_is_piecewise_linear():
    times, factors = [0.0, 2.0, 5.0], [1.0, 1.5, 1.0]
    assert advance(0.0, 1.0, times, factors) == pytest.approx(1.0)
    assert advance(0.0, 3.0, times, factors) == pytest.approx(2.0 + 1.0 * 1.5)
    assert advance(1.0, 4.0, times, factors) == pytest.approx(5.0 + 4.0 - 1.0 - 2.0)
    assert advance(6.0, 1.0, times, factors) == pytest.approx(7.0)


def _run(ops0, s, call_bytes, issue_us):
    """Two ranks run ``ops0``: the all-reduce is issued after ``issue_us`` of host time."""
    cost = dataclasses.replace(_cost(), host_comm_us=issue_us, overlap_slowdown=s,
                               intra=LinkCost(bw_efficiency=1.0, latency_us=0.0))
    progs = {r: Program(r, [dataclasses.replace(op) for op in ops0]) for r in (0, 1)}
    sim = Simulation(_two_ranks(), progs, cost, SimOptions(), {0: [0], 1: [1]})
    return sim.run(), sim


def _ops(c, c2=0.0, bytes_=4e8):
    ar = Op(name="ar", kind="all_reduce", stream="comm", group=(0, 1), group_name="dp",
            bytes=bytes_)
    ops = [_gemm("a", c), ar]
    if c2:
        ops.append(_gemm("b", c2, (0,)))
    return ops


@pytest.mark.parametrize("c, issue_us, bytes_", [
    (4e-3, 1000.0, 4e6),   # the call starts and ends inside the op
    (4e-3, 1000.0, 4e9),   # the op ends while the call runs
    (4e-3, 6000.0, 4e8),   # the call starts after the op: no slowdown
    (4e-3, 0.0, 4e8),      # both start together
])
def test_an_op_pays_for_the_share_it_overlapped(c, issue_us, bytes_):
    _, sim = _run(_ops(c, bytes_=bytes_), S, bytes_, issue_us)
    a, b = float(sim.start[0][1]), float(sim.end[0][1])
    assert a == pytest.approx(issue_us * 1e-6)  # issued then, and nothing keeps it waiting
    assert float(sim.start[0][0]) == 0.0
    assert float(sim.end[0][0]) == pytest.approx(closed_form(0.0, c, a, b, S), rel=1e-12)


def test_the_next_op_runs_slow_until_the_call_ends_then_at_full_rate():
    c, c2 = 1e-3, 8e-3
    _, sim = _run(_ops(c, c2, 4e8), S, 4e8, 500.0)
    a, b = float(sim.start[0][1]), float(sim.end[0][1])
    e1 = closed_form(0.0, c, a, b, S)
    assert float(sim.end[0][0]) == pytest.approx(e1, rel=1e-12)
    assert b < e1 + c2  # the call ends inside b's run
    assert float(sim.end[0][2]) == pytest.approx(closed_form(e1, c2, a, b, S), rel=1e-12)


def test_without_slowdown_the_times_are_the_plain_ones():
    t0, s0 = _run(_ops(4e-3, 2e-3, 4e8), 0.0, 4e8, 1000.0)
    assert float(s0.end[0][0]) == pytest.approx(4e-3)
    assert float(s0.end[0][2]) == pytest.approx(6e-3)
    t1, s1 = _run(_ops(4e-3, 2e-3, 4e8), S, 4e8, 1000.0)
    assert t1 > t0


@pytest.mark.parametrize("overrides", [
    dict(zero_stage=3, global_batch_size=8),
    dict(pp=2, zero_stage=1, global_batch_size=16),
    dict(tp=2, sp=True, zero_stage=2, global_batch_size=8),
])
def test_folded_and_fast_forwarded_steps_equal_the_full_one(overrides):
    cluster = dataclasses.replace(preset_cluster("dgx_h100"), num_nodes=1, gpus_per_node=8)
    model = gpt(hidden_size=2048, num_heads=16, num_kv_heads=16, ffn_hidden_size=8192,
                seq_len=2048, num_layers=4)  # kernels long enough to overlap the calls
    job = build_job(model, cluster, ParallelPlan(**overrides))
    h100 = CostModel.load(CONF_DIR / "profiles" / "dgx_h100.yaml")
    # no host cost per op: so small a model would be host-bound, its kernels issued too late
    # to overlap anything
    cost = dataclasses.replace(h100, overlap_slowdown=0.3, **{
        k: dataclasses.replace(getattr(h100, k), host_us=0.0)
        for k in ("gemm", "attention", "elementwise", "optimizer")})
    full = simulate(job, cost, SimOptions(fold="none", fast_forward=False), trace="none")
    fast = simulate(job, cost, SimOptions(fold="auto"), trace="none")
    plain = simulate(job, dataclasses.replace(cost, overlap_slowdown=0.0),
                     SimOptions(fold="none", fast_forward=False), trace="none")
    assert fast.summary["step_time_s"] == pytest.approx(full.summary["step_time_s"], rel=1e-9)
    assert full.summary["step_time_s"] > plain.summary["step_time_s"]
    # the slowdown is a part of the critical path of its own: the parts add up to the step
    for run in (full, fast, plain):
        assert sum(run.summary["critical_path_s"].values()) == \
            pytest.approx(run.summary["step_time_s"], rel=1e-9)
    assert full.summary["critical_path_s"]["overlap"] > 0
    assert fast.summary["critical_path_s"]["overlap"] == \
        pytest.approx(full.summary["critical_path_s"]["overlap"], rel=1e-9)
    assert "overlap" not in plain.summary["critical_path_s"]


@pytest.mark.parametrize("schedule, v", [("1f1b", 1), ("interleaved", 2), ("gpipe", 1)])
def test_a_pipelines_critical_path_counts_each_instant_once(schedule, v):
    """A send/recv posted in a batch before the op it waits for has ended (Megatron's
    send_backward_recv_forward) is on the path from when that op ended: the parts add up."""
    cluster = dataclasses.replace(preset_cluster("dgx_h100"), num_nodes=1, gpus_per_node=2)
    model = gpt(hidden_size=2048, num_heads=16, num_kv_heads=16, ffn_hidden_size=8192,
                seq_len=2048, num_layers=4)
    job = build_job(model, cluster, ParallelPlan(pp=2, pp_schedule=schedule,
                                                 pp_virtual_stages=v, global_batch_size=4))
    cost = CostModel.load(CONF_DIR / "profiles" / "dgx_h100.yaml")
    s = simulate(job, cost, SimOptions(fold="none", fast_forward=False), trace="none").summary
    assert s["critical_path_s"]["p2p"] > 0
    assert sum(s["critical_path_s"].values()) == pytest.approx(s["step_time_s"], rel=1e-9)
