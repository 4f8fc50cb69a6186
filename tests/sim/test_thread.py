"""Ranks on CPU cores: the thread that computes also issues the collectives and send/recvs,
so their host time (per call, by the group's role) is compute-thread time, not a separate
host's; the fit frees that time per role."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tests.calibrate.test_stepfit import CPU_TRUE_KERNELS, _cpu_jobs
from twin.calibrate.stepfit import CPU_STEP_FREE, fit_start, fit_steps, get, predict, with_params
from twin.cost import CostModel, call_role, profile_problems
from twin.schedule.ir import Op
from twin.sim.run import simulate
from twin.sim.thread import issue_cost, thread_charges

COST = CostModel(name="t", host_comm_us=50.0, host_comm_per_rank_us=2.0,
                 host_comm_by_group_us={"dp": 400.0, "tp": 90.0})


def _ops():
    return [
        Op("a", "gemm", "compute"),
        Op("x", "all_reduce", "comm", group=(0, 1), group_name="dp"),
        Op("y", "all_gather", "comm", group=(0, 1, 2, 3), group_name="tp-cp"),
        Op("b", "elementwise", "compute"),
        Op("m", "alloc", "mem"),
        Op("z", "send", "p2p", group=(0, 1), group_name="pp", peer=1),
        Op("c", "gemm", "compute"),
        Op("w", "all_reduce", "comm", group=(0, 1, 2), group_name="ep"),
    ]


def test_each_call_is_charged_to_the_compute_op_its_thread_runs_next():
    ops = _ops()
    assert [call_role(op) for op in ops if op.is_collective or op.is_p2p] == ["dp", "tp", "pp", "ep"]
    ch = thread_charges(ops, COST)
    assert set(ch) == {3, 6}  # b after x and y; c after z, and w (after every compute op)
    assert ch[3].calls == (("dp", 1), ("tp", 1)) and ch[3].members == 2 + 4
    assert ch[3].seconds == pytest.approx((400 + 90 + 2 * 6) * 1e-6)
    # the send/recv: no member cost; ep has no role price of its own: host_comm_us
    assert ch[6].calls == (("ep", 1), ("pp", 1)) and ch[6].members == 3
    assert ch[6].seconds == pytest.approx((50 + 50 + 2 * 3) * 1e-6)
    free = issue_cost(COST)
    assert all(free.host_time(op) == 0 for op in ops if not op.is_compute)


def test_fsdps_calls_have_a_role_of_their_own_priced_as_dp_until_given_one():
    ag = Op("g", "all_gather", "comm.ag", group=(0, 1), group_name="dp", paradigm="fsdp")
    assert call_role(ag) == "fsdp"
    assert COST.comm_host_us("fsdp") == 400.0  # no fsdp price: the dp group's
    own = dataclasses.replace(COST, host_comm_by_group_us={"dp": 400.0, "fsdp": 9000.0})
    assert own.comm_host_us("fsdp") == 9000.0 and own.comm_host_us("dp") == 400.0
    assert dataclasses.replace(COST, host_comm_by_group_us={}).comm_host_us("fsdp") == 50.0


def _ddp_cpu_job():
    return next(j for j in _cpu_jobs() if j.parallel.dp == 2 and j.model.num_layers == 4)


def test_on_cpu_cores_a_calls_host_time_is_compute_thread_time():
    """A DDP step on shared cores is longer by about its dp calls' host time (each rank's
    thread pays for its own calls); the same time on a host thread of its own would hide
    behind the backward."""
    job = _ddp_cpu_job()
    base = CostModel(name="cpu", core_share=True, kernels_by_dtype={"fp32": CPU_TRUE_KERNELS})
    step0 = simulate(job, base).summary.step_time_s
    slow = dataclasses.replace(base, host_comm_by_group_us={"dp": 20000.0})
    calls = sum(1 for op in _programs(job)[0] if op.is_collective and call_role(op) == "dp")
    assert calls >= 1
    step1 = simulate(job, slow).summary.step_time_s
    assert step1 - step0 == pytest.approx(calls * 0.02, rel=0.1)


def _programs(job):
    from twin.schedule.builder import build_schedule
    s = build_schedule(job)
    return [s.program(r).ops for r in range(job.grid.world_size)]


def test_role_prices_are_a_checked_profile_field():
    d = COST.to_dict()
    assert CostModel.from_dict(d).host_comm_by_group_us == {"dp": 400.0, "tp": 90.0}
    d["host_comm_by_group_us"] = {"dp": -1.0}
    assert any("host_comm_by_group_us.dp" in p for p in profile_problems(d))
    d["host_comm_by_group_us"] = 5
    assert any("must map a group role" in p for p in profile_problems(d))


def test_a_cpu_fit_recovers_each_roles_call_cost():
    roles = [f for f in CPU_STEP_FREE if f[1].startswith("host_comm_by_group_us.")]
    assert {f[1] for f in roles} == {"host_comm_by_group_us.dp", "host_comm_by_group_us.fsdp",
                                     "host_comm_by_group_us.tp"}
    truth = CostModel(name="cpu-truth", core_share=True, base_latency_us=60.0,
                      provenance={"source": "traces"}, kernels_by_dtype={"fp32": CPU_TRUE_KERNELS},
                      host_comm_by_group_us={"dp": 6000.0, "fsdp": 9000.0, "tp": 1500.0})
    assert get(truth, None, "host_comm_by_group_us.tp") == 1500.0
    assert with_params(truth, [700.0], roles[:1]).host_comm_by_group_us["dp"] == 700.0
    jobs = _cpu_jobs()
    jobs += [dataclasses.replace(j, parallel=dataclasses.replace(j.parallel, zero_stage=3))
             for j in jobs if j.parallel.dp == 2 and j.parallel.micro_batch_size == 1]
    rng = np.random.default_rng(2)
    measured = [p.step_s * float(np.exp(rng.normal(0, 0.01))) for p in predict(jobs, truth, 1)]
    # where `paratwin calibrate runs=` starts on CPU cores: every call at 100 us
    assert fit_start(dataclasses.replace(truth, host_comm_by_group_us={}), None,
                     shared_cpu=True).comm_host_us("dp") == 100.0
    start = dataclasses.replace(truth, host_comm_by_group_us={"dp": 2000.0, "fsdp": 2000.0,
                                                              "tp": 500.0})
    fit = fit_steps(jobs, measured, start, workers=1, free=tuple(roles), rounds=2)
    assert fit.params["host_comm_by_group_us.dp"] == pytest.approx(6000.0, rel=0.2)
    assert fit.params["host_comm_by_group_us.fsdp"] == pytest.approx(9000.0, rel=0.2)
    assert fit.params["host_comm_by_group_us.tp"] == pytest.approx(1500.0, rel=0.2)
