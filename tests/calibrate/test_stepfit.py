"""Fitting the cost model to whole-run step times: the critical path re-times exactly, and the
fit recovers known parameters from synthetic runs with noise."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

from tests.conftest import gpt
from twin.calibrate import stepfit
from twin.calibrate.stepfit import (
    CPU_FREE,
    CPU_STEP_FREE,
    FREE,
    ROBUST_ROWS,
    fit_steps,
    free_for,
    predict,
    simulate_path,
    with_params,
)
from twin.cost import CostModel, KernelCost
from twin.kernelshape import shape_key
from twin.schedule.builder import build_schedule
from twin.sim.critical import critical_path
from twin.sim.engine import SimOptions, Simulation, fold_classes
from twin.spec import ClusterSpec, GPUSpec, ParallelPlan, build_job
from twin.spec.cluster import IntraNodeSpec

A100ISH = ClusterSpec(name="a100ish", num_nodes=1, gpus_per_node=8,
                      gpu=GPUSpec(name="g", peak_tflops={"bf16": 312.0}, hbm_GB=80,
                                  hbm_bw_GBps=2039, sm_count=108))


def _jobs():
    out = []
    for h, (tp, pp), mb in itertools.product((1024, 4096), ((1, 1), (2, 1), (4, 1), (1, 2), (2, 2)),
                                             (1, 8)):
        model = gpt(num_layers=4, hidden_size=h, num_heads=16, num_kv_heads=16,
                    ffn_hidden_size=4 * h, vocab_size=1024, seq_len=1024)
        dp = 8 // (tp * pp) // 2
        cl = dataclasses.replace(A100ISH, gpus_per_node=tp * pp * dp)
        out.append(build_job(model, cl, ParallelPlan(tp=tp, pp=pp, dp=dp, micro_batch_size=mb,
                                                     global_batch_size=mb * dp * 4)))
    return out


TRUE = CostModel(name="truth", base_latency_us=20.0, p2p_latency_us=30.0, host_comm_us=40.0,
                 p2p_host_sync=True,
                 gemm=KernelCost(efficiency=0.6, launch_us=6.0, host_us=25.0, tile=128,
                                 tile_exponent=0.5),
                 attention=KernelCost(efficiency=0.3, mem_efficiency=0.6, launch_us=8.0, host_us=60.0),
                 elementwise=KernelCost(mem_efficiency=0.5, launch_us=5.0, host_us=30.0),
                 optimizer=KernelCost(mem_efficiency=0.7, launch_us=20.0, host_us=100.0))


@pytest.mark.parametrize("k", [0, 4, 9, 13])
def test_the_critical_path_retimes_to_the_simulated_step(k):
    job = _jobs()[k]
    classes = fold_classes(job, "all")
    sched = build_schedule(job)
    sim = Simulation(job, {r: sched.program(r) for r in classes}, TRUE, SimOptions(fold="all"),
                     classes)
    step = sim.run()
    path = critical_path(sim, TRUE.p2p_latency_us * 1e-6)
    assert path.step_s == pytest.approx(step)
    assert path.retime(TRUE, job.cluster.gpu) == pytest.approx(step, rel=2e-3)
    assert sum(path.parts(TRUE, job.cluster.gpu).values()) == pytest.approx(step, rel=2e-3)


@pytest.mark.parametrize("compile_", [False, True])
def test_the_path_retimes_ops_an_eager_factor_prices_apart(compile_):
    """With an eager factor folded in (the H100 profile's), FSDP2's copies (one kernel) cost
    the host host_us / f and, compiled, the ops outside the blocks f times the fused ops':
    the path counts each in its kind's units, so it still re-times to the step."""
    model = gpt(num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=4, ffn_hidden_size=1024,
                vocab_size=512, seq_len=256)
    job = build_job(model, dataclasses.replace(A100ISH, gpus_per_node=2),
                    ParallelPlan(zero_stage=3, compile=compile_, global_batch_size=4))
    cost = dataclasses.replace(TRUE, eager_elementwise=4.0, p2p_host_sync=False,
                               elementwise=dataclasses.replace(TRUE.elementwise, host_us=400.0))
    cost = cost.compiled() if compile_ else cost
    classes = fold_classes(job, "all")
    sched = build_schedule(job)
    sim = Simulation(job, {r: sched.program(r) for r in classes}, cost, SimOptions(fold="all"),
                     classes)
    step = sim.run()
    path = critical_path(sim, 0.0)
    assert path.host  # host-bound: the host's issuing is on the path
    assert path.retime(cost, job.cluster.gpu) == pytest.approx(step, rel=2e-3)



def test_the_path_prices_each_dtype_at_its_own_host_time():
    """A profile whose FP8 GEMMs cost the host more than its bf16 ones (kernels_by_dtype): the
    path counts issued ops per kind and dtype, so it re-times to the step (counted per kind
    and priced at the kind's default it was 78% short at 400 us)."""
    cl = ClusterSpec(name="h100ish", num_nodes=1, gpus_per_node=2,
                     gpu=GPUSpec(name="g", peak_tflops={"bf16": 989.0, "fp8": 1979.0}, hbm_GB=80,
                                 hbm_bw_GBps=3350, sm_count=132))
    model = gpt(num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=4, ffn_hidden_size=1024,
                vocab_size=512, seq_len=256)
    job = build_job(model, cl, ParallelPlan(float8="tensorwise", global_batch_size=4))
    cost = dataclasses.replace(TRUE, p2p_host_sync=False, kernels_by_dtype={
        "fp8": {"gemm": dataclasses.replace(TRUE.gemm, host_us=400.0)}})
    classes = fold_classes(job, "all")
    sched = build_schedule(job)
    sim = Simulation(job, {r: sched.program(r) for r in classes}, cost, SimOptions(fold="all"),
                     classes)
    step = sim.run()
    path = critical_path(sim, 0.0)
    assert path.host["gemm:fp8"] > 0 and path.host["gemm:bf16"] > 0
    assert path.retime(cost, job.cluster.gpu) == pytest.approx(step, rel=2e-3)

def test_the_fit_recovers_known_parameters_from_noisy_runs():
    jobs = _jobs()
    rng = np.random.default_rng(7)
    measured = [p.step_s * float(np.exp(rng.normal(0, 0.02))) for p in predict(jobs, TRUE, 1)]
    start = with_params(TRUE, [0.5 * v if name in ("efficiency", "mem_efficiency") else 2.0 * v
                               for v, (_, name, _, _) in zip(
                                   [getattr(TRUE if k is None else getattr(TRUE, k), n)
                                    for k, n, _, _ in FREE], FREE)])
    fit = fit_steps(jobs, measured, start, workers=1, shapes=False)
    pred = np.array([p.step_s for p in predict(jobs, fit.cost, 1)])
    err = pred / np.array(measured) - 1
    assert np.median(np.abs(err)) < 0.03 and np.max(np.abs(err)) < 0.08
    # what the runs pin down is recovered: the GEMMs' efficiency and the host's issue time
    assert fit.params["gemm.efficiency"] == pytest.approx(0.6, rel=0.15)
    assert fit.params["elementwise.host_us"] == pytest.approx(30.0, rel=0.25)
    assert len(fit.rounds) == 3 and fit.rounds[-1]["fitted_median_abs_error"] < 0.03


def test_a_path_is_found_for_every_kind_of_job():
    for job in _jobs()[:6]:
        path = simulate_path(job, TRUE)
        assert path.step_s > 0 and sum(path.compute.values()) > 0


CPU = ClusterSpec(name="cpu", num_nodes=1, gpus_per_node=2, cores_per_node=2,
                  gpu=GPUSpec(name="core", peak_tflops={"fp32": 0.07}, hbm_GB=12, hbm_bw_GBps=31),
                  intra=IntraNodeSpec(kind="shared_cpu", bw_GBps=2.0, latency_us=50.0))
CPU_TRUE_KERNELS = {"gemm": KernelCost(efficiency=0.9, launch_us=400.0),
                    "attention": KernelCost(efficiency=0.5, launch_us=300.0),
                    "elementwise": KernelCost(mem_efficiency=0.4, launch_us=150.0),
                    "optimizer": KernelCost(mem_efficiency=0.3, launch_us=2000.0)}


def _cpu_jobs():
    out = []
    for h, layers, (tp, pp), mb in itertools.product((128, 256), (2, 4), ((1, 1), (2, 1), (1, 2)),
                                                     (1, 2)):
        model = gpt(num_layers=layers, hidden_size=h, num_heads=4, num_kv_heads=4,
                    ffn_hidden_size=4 * h, vocab_size=512, seq_len=64, dtype="fp32")
        dp = 2 // (tp * pp)
        out.append(build_job(model, CPU, ParallelPlan(tp=tp, pp=pp, dp=dp, micro_batch_size=mb,
                                                      global_batch_size=mb * dp * 2)))
    return out


def test_a_shared_cpu_fit_moves_the_kernels_its_ops_are_timed_with():
    """A CPU profile keeps its kernels per dtype (kernels_by_dtype.fp32, from traces): the fit
    must change those, and on a shared core the framework's cost per op is launch_us."""
    jobs = _cpu_jobs()
    truth = CostModel(name="cpu-truth", core_share=True, base_latency_us=60.0,
                      kernels_by_dtype={"fp32": CPU_TRUE_KERNELS})
    rng = np.random.default_rng(3)
    measured = [p.step_s * float(np.exp(rng.normal(0, 0.02))) for p in predict(jobs, truth, 1)]
    start = dataclasses.replace(truth, kernels_by_dtype={"fp32": {
        k: dataclasses.replace(v, launch_us=v.launch_us / 4) for k, v in CPU_TRUE_KERNELS.items()}})
    before = np.array([p.step_s for p in predict(jobs, start, 1)]) / np.array(measured) - 1
    fit = fit_steps(jobs, measured, start, workers=1)
    assert "gemm.host_us" not in fit.params  # the CPU set: no separate host thread
    after = np.array([p.step_s for p in predict(jobs, fit.cost, 1)]) / np.array(measured) - 1
    assert np.median(np.abs(before)) > 0.15
    assert np.median(np.abs(after)) < 0.03
    # from a quarter of the truth to near it (GEMM overhead and efficiency trade a little)
    assert 250.0 < fit.cost.kernel("gemm", "fp32").launch_us < 800.0
    assert fit.cost.kernel("gemm", "fp32") is not fit.cost.gemm


def test_kernel_shape_factors_learn_what_the_smooth_model_cannot():
    """Runs whose own GEMM shapes are 1.6x slower than the model (cuBLAS's jagged kernel
    choice): without shape factors the fit leaves them 18-30% too fast, with them it learns
    those shapes' factors, and the other shapes stay near 1."""
    jobs = _jobs()
    keys = [{shape_key(op) for op in p.compute if op.kind == "gemm"} for p in predict(jobs, TRUE, 1)]
    cell = [i for i, j in enumerate(jobs) if j.model.hidden_size == 4096 and j.parallel.tp == 2]
    own = set().union(*(keys[i] for i in cell)) - set().union(
        *(k for i, k in enumerate(keys) if i not in cell))
    truth = dataclasses.replace(TRUE, shape_factors={k: 1.6 for k in own})
    rng = np.random.default_rng(7)
    measured = np.array([p.step_s * float(np.exp(rng.normal(0, 0.01))) for p in predict(jobs, truth, 1)])

    def cell_errors(fit):
        pred = np.array([p.step_s for p in predict([jobs[i] for i in cell], fit.cost, 1)])
        return np.abs(pred / measured[cell] - 1)

    smooth = fit_steps(jobs, measured, TRUE, rounds=2, workers=1, shapes=False)
    shaped = fit_steps(jobs, measured, TRUE, rounds=2, workers=1, shapes=True)
    assert smooth.cost.shape_factors == {} and cell_errors(smooth).max() > 0.15
    assert cell_errors(shaped).max() < 0.03
    factors = shaped.cost.shape_factors
    mean_log = lambda ks: np.mean([np.log(factors[k]) for k in ks])  # noqa: E731
    assert mean_log(own & set(factors)) > np.log(1.08)
    assert abs(mean_log(set(factors) - own)) < np.log(1.05)
    assert shaped.rounds[-1]["shapes"] == len(factors)


def test_a_gemm_ceiling_holds_the_efficiency_and_fits_the_size_curve():
    """With the largest GEMMs' efficiency given (the GPU's maximum achievable matmul), the fit
    frees how efficiency rises with size (half_flops) and recovers it from the runs."""
    truth = dataclasses.replace(TRUE, gemm=dataclasses.replace(TRUE.gemm, efficiency=0.8,
                                                                half_flops=5e9))
    jobs = _jobs()
    rng = np.random.default_rng(5)
    measured = [p.step_s * float(np.exp(rng.normal(0, 0.01))) for p in predict(jobs, truth, 1)]
    fit = fit_steps(jobs, measured, TRUE, rounds=2, workers=1, shapes=False, gemm_ceiling=0.8)
    assert "gemm.efficiency" not in fit.params and fit.cost.gemm.efficiency == 0.8
    assert fit.params["gemm.half_flops"] == pytest.approx(5e9, rel=0.3)
    with pytest.raises(ValueError, match="gemm_ceiling=1.5 must be a fraction of peak"):
        fit_steps(jobs, measured, TRUE, workers=1, gemm_ceiling=1.5)


def test_a_fit_from_a_traces_profile_holds_the_kernels_the_traces_measured():
    """A shared-CPU runs fit that starts from a traces profile frees what a real step adds
    (each kind's cost per op, the optimizer, issuing collectives and send/recv), not the
    kernels' efficiencies; from another start every CPU field is free."""
    traced = CostModel(name="t", provenance={"source": "traces"},
                       kernels_by_dtype={"fp32": CPU_TRUE_KERNELS})
    assert free_for(CPU, base=traced) == CPU_STEP_FREE
    assert free_for(CPU, base=dataclasses.replace(traced, provenance={})) == CPU_FREE
    assert not any(f[1] == "efficiency" for f in CPU_STEP_FREE)
    assert {f[0] for f in CPU_STEP_FREE if f[1] == "launch_us"} == {
        "gemm", "attention", "elementwise", "optimizer"}
    jobs = _cpu_jobs()[:6]
    truth = CostModel(name="cpu-truth", core_share=True, base_latency_us=60.0,
                      kernels_by_dtype={"fp32": CPU_TRUE_KERNELS})
    measured = [p.step_s for p in predict(jobs, truth, 1)]
    start = dataclasses.replace(truth, provenance={"source": "traces"},
                                kernels_by_dtype={"fp32": {
                                    k: dataclasses.replace(v, launch_us=v.launch_us / 3)
                                    for k, v in CPU_TRUE_KERNELS.items()}})
    fit = fit_steps(jobs, measured, start, workers=1)
    assert "gemm.efficiency" not in fit.params and "gemm.launch_us" in fit.params
    assert fit.cost.kernel("gemm", "fp32").efficiency == CPU_TRUE_KERNELS["gemm"].efficiency


def test_few_runs_are_fitted_by_least_squares_many_robustly(monkeypatch):
    """One run 40% slower than the model can explain: under least squares (few runs, each a
    configuration of its own) the fit splits the difference; the robust loss of a large set
    lets that run go and fits the others closer."""
    jobs = _cpu_jobs()[:8]
    truth = CostModel(name="cpu-truth", core_share=True, base_latency_us=60.0,
                      kernels_by_dtype={"fp32": CPU_TRUE_KERNELS})
    measured = [p.step_s for p in predict(jobs, truth, 1)]
    measured[0] *= 1.4
    err = {}
    for label, rows in (("least_squares", ROBUST_ROWS), ("robust", 1)):
        monkeypatch.setattr(stepfit, "ROBUST_ROWS", rows)
        fit = fit_steps(jobs, measured, truth, workers=1)
        err[label] = np.array([p.step_s for p in predict(jobs, fit.cost, 1)]) / np.array(measured) - 1
    assert abs(err["least_squares"][0]) < abs(err["robust"][0])
    assert np.median(np.abs(err["robust"][1:])) < np.median(np.abs(err["least_squares"][1:]))
