"""Ranks on shared CPU cores: a collective call that starts while its node's cores all
compute waits ``CostModel.busy_handoff_us`` more (its thread woken into a full run queue);
one that starts while a core is free does not."""

from __future__ import annotations

import dataclasses

import pytest

from tests.conftest import gpt
from tests.sim.test_mechanisms import PEAK, _cost, _gemm
from twin.schedule.ir import Op, Program
from twin.sim.engine import SimOptions, Simulation
from twin.spec import ClusterSpec, GPUSpec, IntraNodeSpec, ParallelPlan, build_job

W_US = 700.0


def _host(cores: int):
    cl = ClusterSpec(name="cpu2", num_nodes=1, gpus_per_node=2, cores_per_node=cores,
                     gpu=GPUSpec(name="cpu", peak_tflops={"bf16": PEAK / 1e12}, hbm_GB=8,
                                 hbm_bw_GBps=1e6),
                     intra=IntraNodeSpec(kind="shared_cpu", bw_GBps=1.0))
    return build_job(gpt(), cl, ParallelPlan(dp=2, global_batch_size=2))


def _call_s(call_first: bool, cores: int, wait_us: float) -> float:
    """How long the 4-byte all-reduce takes on rank 0 beside a 10 ms GEMM on each rank:
    issued after it (the cores are computing when the call starts) or before it."""
    ar = Op(name="ar", kind="all_reduce", stream="comm", group=(0, 1), group_name="dp", bytes=4.0)
    ops = [ar, _gemm("g", 1e-2)] if call_first else [_gemm("g", 1e-2), ar]
    cost = dataclasses.replace(_cost(), busy_handoff_us=wait_us)
    progs = {r: Program(r, [dataclasses.replace(op) for op in ops]) for r in (0, 1)}
    sim = Simulation(_host(cores), progs, cost, SimOptions(), {0: [0], 1: [1]})
    sim.run()
    i = 0 if call_first else 1
    return float(sim.end[0][i] - sim.start[0][i])


def test_a_call_beside_busy_cores_waits_for_a_time_slice():
    plain = _call_s(False, 2, 0.0)
    assert _call_s(False, 2, W_US) == pytest.approx(plain + W_US * 1e-6, rel=1e-9)


@pytest.mark.parametrize("call_first, cores", [(True, 2), (False, 4)])
def test_a_call_with_a_free_core_does_not_wait(call_first, cores):
    # the call starts before the second rank computes, or the host has cores to spare
    assert _call_s(call_first, cores, W_US) == pytest.approx(_call_s(call_first, cores, 0.0),
                                                             rel=1e-12)
