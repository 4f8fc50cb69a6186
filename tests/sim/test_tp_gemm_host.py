"""DTensor's dispatch: PyTorch's tensor parallelism holds each TP linear's weight as a DTensor,
and every op on it runs a Python dispatch (sharding propagation, wrapping the local result)
that Megatron's plain tensors do not. torch.profiler shows it as PythonSubclass and
Redistribute events: on this host's 2-rank val_small (h512) they take 60 ms of a TP step's
~300 ms (84 ms under SP, where the calls are 2.3x as many), so it is a cost per TP GEMM
(``CostModel.host_tp_gemm_us``) beside the cost per TP call (host_comm_by_group_us.tp)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tests.calibrate.test_stepfit import CPU, CPU_TRUE_KERNELS
from tests.conftest import gpt
from twin.calibrate.stepfit import CPU_STEP_FREE, fit_start, fit_steps, predict, simulate_path
from twin.cost import CostModel
from twin.schedule.builder import build_schedule
from twin.schedule.ir import Op
from twin.sim.codes import signature
from twin.sim.run import simulate
from twin.sim.thread import issue_cost, thread_charges
from twin.spec import ParallelPlan, build_job

TP_US = 600.0


def _job(tp: int = 2, sp: bool = False, layers: int = 2, h: int = 128):
    model = gpt(num_layers=layers, hidden_size=h, num_heads=4, num_kv_heads=4,
                ffn_hidden_size=4 * h, vocab_size=512, seq_len=64, dtype="fp32")
    return build_job(model, CPU, ParallelPlan(tp=tp, dp=2 // tp, sp=sp, micro_batch_size=1,
                                              global_batch_size=2 * (2 // tp)))


def _ops(job):
    return build_schedule(job).program(0).ops


@pytest.mark.parametrize("tp, sp, paradigm", [(2, False, "tp"), (2, True, "sp"), (1, False, "")])
def test_a_tensor_parallel_rank_s_gemms_carry_its_paradigm(tp, sp, paradigm):
    job = _job(tp, sp)
    ops = _ops(job)
    gemms = [op for op in ops if op.kind == "gemm"]
    # per micro-batch: forward, dgrad and wgrad of qkv, out-proj, fc1, fc2 per layer, and
    # of the head
    assert len(gemms) == 3 * (4 * 2 + 1) * job.parallel.num_microbatches
    assert {op.paradigm for op in gemms} == {paradigm}
    assert sum(op.tp_gemm for op in ops) == (len(gemms) if tp > 1 else 0)


def test_each_tp_gemm_charges_its_thread_and_its_host():
    cost = CostModel(name="t", host_tp_gemm_us=TP_US, host_comm_by_group_us={"tp": 90.0})
    ops = [Op("a", "gemm", "compute", paradigm="tp"),
           Op("x", "all_reduce", "comm", group=(0, 1), group_name="tp", paradigm="tp"),
           Op("b", "gemm", "compute", paradigm="sp"),
           Op("c", "gemm", "compute"),
           Op("d", "elementwise", "compute", paradigm="tp")]
    ch = thread_charges(ops, cost)
    assert set(ch) == {0, 2}  # the TP GEMMs; c and d pay nothing of their own
    assert ch[0].tp_gemm and ch[0].calls == () and ch[0].seconds == pytest.approx(TP_US * 1e-6)
    assert ch[2].tp_gemm and ch[2].calls == (("tp", 1),)
    assert ch[2].seconds == pytest.approx((TP_US + 90.0) * 1e-6)
    # a GPU's host issues it (kernel host_us plus the dispatch); a CPU thread's issue
    # timeline carries none of it
    gpu = dataclasses.replace(cost, gemm=dataclasses.replace(cost.gemm, host_us=20.0))
    assert gpu.host_time(ops[0]) == pytest.approx((20.0 + TP_US) * 1e-6)
    assert gpu.host_time(ops[3]) == pytest.approx(20.0 * 1e-6)
    assert signature(ops[0]) != signature(ops[2])  # (the host plan prices per signature)
    assert issue_cost(cost).host_time(ops[0]) == 0.0


def test_on_cpu_cores_the_dispatch_is_compute_thread_time_and_the_path_retimes_it():
    """A TP step on shared cores is longer by its rank's TP GEMMs times the dispatch (each
    rank's thread pays for its own, the two at once); the critical path re-times it."""
    job = _job(2)
    base = CostModel(name="cpu", core_share=True, kernels_by_dtype={"fp32": CPU_TRUE_KERNELS})
    slow = dataclasses.replace(base, host_tp_gemm_us=5000.0)
    run0, run1 = simulate(job, base), simulate(job, slow)
    n = sum(op.tp_gemm for op in _ops(job))
    assert run1.summary.step_time_s - run0.summary.step_time_s == pytest.approx(n * 5e-3, rel=0.1)
    path = simulate_path(job, base)  # the slow model's step from the fast one's path
    assert path.step_s == pytest.approx(run0.summary.step_time_s)
    assert path.host["tp_gemm"] == n
    assert path.retime(slow, job.cluster.gpu) == pytest.approx(run1.summary.step_time_s, rel=0.02)


def test_a_cpu_fit_tells_the_dispatch_per_gemm_from_the_cost_per_call():
    """TP and SP steps run the same GEMMs but SP makes about twice the calls: runs of both
    tell a cost per GEMM from a cost per call (the two the fit frees for TP)."""
    assert (None, "host_tp_gemm_us", 0.1, 50000.0) in CPU_STEP_FREE
    free = tuple(f for f in CPU_STEP_FREE if f[1] in ("host_tp_gemm_us", "host_comm_by_group_us.tp"))
    truth = CostModel(name="cpu-truth", core_share=True, base_latency_us=60.0,
                      provenance={"source": "traces"}, kernels_by_dtype={"fp32": CPU_TRUE_KERNELS},
                      host_comm_by_group_us={"tp": 1500.0}, host_tp_gemm_us=TP_US)
    jobs = [_job(2, sp, layers, h) for sp in (False, True) for layers in (2, 4) for h in (128, 256)]
    rng = np.random.default_rng(4)
    measured = [p.step_s * float(np.exp(rng.normal(0, 0.01))) for p in predict(jobs, truth, 1)]
    # where `paratwin calibrate runs=` starts on CPU cores: 100 us per TP GEMM
    start = fit_start(dataclasses.replace(truth, host_comm_by_group_us={"tp": 3000.0},
                                          host_tp_gemm_us=0.0), None, shared_cpu=True)
    assert start.host_tp_gemm_us == 100.0
    fit = fit_steps(jobs, measured, start, workers=1, free=free, rounds=2)
    assert fit.params["host_tp_gemm_us"] == pytest.approx(TP_US, rel=0.2)
    assert fit.params["host_comm_by_group_us.tp"] == pytest.approx(1500.0, rel=0.2)


def test_a_fit_whose_runs_have_no_tensor_parallelism_leaves_its_costs_unmeasured():
    """DDP-only runs put no TP GEMM and no TP call on any critical path: the fit cannot tell
    their costs, so the fitted profile keeps the ones it was given (here none: 0 per GEMM and
    no TP role, so a TP call costs host_comm_us) instead of fit_start's 100 us guesses, and
    says which fields no run exercised."""
    free = tuple(f for f in CPU_STEP_FREE if f[1] in ("host_tp_gemm_us", "host_comm_by_group_us.tp",
                                                      "host_comm_by_group_us.dp"))
    truth = CostModel(name="cpu-truth", core_share=True, base_latency_us=60.0,
                      provenance={"source": "traces"}, kernels_by_dtype={"fp32": CPU_TRUE_KERNELS},
                      host_comm_by_group_us={"dp": 4000.0})
    jobs = [_job(1, False, layers, h) for layers in (2, 4) for h in (128, 256)]
    measured = [p.step_s for p in predict(jobs, truth, 1)]
    given = dataclasses.replace(truth, host_comm_by_group_us={})
    start = fit_start(given, None, shared_cpu=True)
    assert start.host_tp_gemm_us == 100.0
    fit = fit_steps(jobs, measured, start, workers=1, free=free, rounds=1, keep=given)
    assert fit.unexercised == ["host_comm_by_group_us.tp", "host_tp_gemm_us"]
    assert fit.cost.host_tp_gemm_us == 0.0
    assert "tp" not in fit.cost.host_comm_by_group_us
    assert fit.params["host_tp_gemm_us"] == 0.0
    assert fit.params["host_comm_by_group_us.tp"] == fit.cost.host_comm_us
    assert fit.cost.host_comm_by_group_us["dp"] > 100.0  # measured: moved towards 4,000
    # without a profile to keep, they keep where the fit started
    fit = fit_steps(jobs, measured, start, workers=1, free=free, rounds=1)
    assert fit.cost.host_tp_gemm_us == 100.0
    assert fit.unexercised == ["host_comm_by_group_us.tp", "host_tp_gemm_us"]
