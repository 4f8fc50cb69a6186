"""A GPU traces fit's host cost: scaled to the issue time of host-bound replays (closed form),
and on the H200 replays stored in benchmarks/results (in-sample, and one held out)."""

from __future__ import annotations

import dataclasses
import types
from pathlib import Path

import pytest

from twin.calibrate.gpuhost import HOST_BOUND, gpu_host, host_bound, host_scale
from twin.calibrate.traces import fit_traces, load_run
from twin.cost import CostModel, KernelCost
from twin.schedule.ir import Op
from twin.sim.run import simulate

H200 = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "h200_20261204d" / "execute"


def op(kind: str) -> Op:
    return Op(name=kind, kind=kind, stream="compute", shape=(8, 8, 8), dtype="bf16", flops=1.0)


def run(step_s: float, issued_s: float, ops: list[Op]):
    return types.SimpleNamespace(step_s=step_s, host_issue_s={"0": issued_s}, programs={0: ops},
                                 host_issue_by_kind_s={})


def test_host_scale_matches_the_host_bound_runs_issue_time():
    cost = CostModel(name="c", gemm=KernelCost(host_us=10.0), elementwise=KernelCost(host_us=5.0))
    ops = [op("gemm")] * 30 + [op("elementwise")] * 40  # 300 + 200 us modelled
    bound = run(1.0e-3, 0.95e-3, ops)
    assert host_bound(bound) and not host_bound(run(1e-3, HOST_BOUND * 1e-3 * 0.99, ops))
    scale, ranks = host_scale([bound, run(1e-3, 0.1e-3, ops)], cost)  # the device-bound one: left out
    assert scale == pytest.approx(0.95e-3 / 500e-6) and ranks == 1
    assert host_scale([run(1e-3, 0.1e-3, ops)], cost) == (None, 0)


def test_gpu_host_keeps_the_start_kernels_and_scales_their_host_cost():
    base = CostModel(name="b", gemm=KernelCost(efficiency=0.8, host_us=10.0))
    fitted = {"gemm": KernelCost(efficiency=0.3, host_us=0.0)}
    ops = [op("gemm")] * 10
    d, by, fits, report = gpu_host([run(1e-3, 1e-3, ops)], base, fitted, {"bf16": dict(fitted)},
                                   {"gemm/bf16": object()}, {"gemm": 4.0}, start_kernels=True)
    assert d["gemm"].efficiency == 0.8 and d["gemm"].host_us == pytest.approx(100.0)
    assert by["bf16"]["gemm"] == d["gemm"] and fits == {} and report["host_scale"] == pytest.approx(10.0)
    # fitted kernels kept, and without a start host cost the gap between ops is scaled
    d, _, fits, _ = gpu_host([run(1e-3, 1e-3, ops)], CostModel(name="z", gemm=KernelCost(host_us=0.0)),
                             fitted, {}, {"k": 1}, {"gemm": 4.0}, start_kernels=False)
    assert d["gemm"].efficiency == 0.3 and d["gemm"].host_us == pytest.approx(100.0) and fits


@pytest.mark.skipif(not H200.is_dir(), reason="the stored H200 replays are not here")
def test_h200_replays_host_bound_fit_and_a_held_out_one():
    """GPT-2 small at micro-batch 1 (host-bound: the host issued its step in 15.0 of 15.7 ms)
    fitted with the sweep's kernels; at micro-batch 8 (held out) within 10% (-11.5% unscaled)."""
    start = CostModel.load(Path(__file__).resolve().parents[2] / "conf" / "profiles" / "h200_sweep.yaml")
    mb1, mb8 = load_run(H200 / "gpt2_small"), load_run(H200 / "gpt2_small_mb8")
    assert host_bound(mb1) and not host_bound(mb8)
    profile, report = fit_traces([mb1], "t", start, start_kernels=True)
    assert report["host_bound"]["host_scale"] == pytest.approx(2.0, rel=0.1)
    assert profile.gemm == dataclasses.replace(start.gemm, host_us=profile.gemm.host_us)
    for r, tol in ((mb1, 0.1), (mb8, 0.1)):
        assert simulate(r.job, profile).summary.step_time_s / r.step_s - 1 == pytest.approx(0, abs=tol)
    assert simulate(mb8.job, start).summary.step_time_s / mb8.step_s - 1 < -0.1  # unscaled


@pytest.mark.skipif(not H200.is_dir(), reason="the stored H200 replays are not here")
def test_only_host_bound_runs_fit_no_kernels_without_a_start_profile_to_keep():
    """Every run host-bound: their spans time the host's launch lag, so the fit refuses to
    take kernels from them (one line naming both fixes) unless told to keep the start's."""
    from twin.calibrate.traces import TraceError

    mb1 = load_run(H200 / "gpt2_small")
    with pytest.raises(TraceError, match="bound by its host.*start_kernels=true"):
        fit_traces([mb1], "t")
    start = CostModel.load(Path(__file__).resolve().parents[2] / "conf" / "profiles" / "h200_sweep.yaml")
    assert fit_traces([mb1], "t", start, start_kernels=True)[1]["host_bound"]["runs"]


def test_measured_host_per_kind_is_shared_out_to_the_issue_time():
    """A host-bound run that recorded its host time per kind: each kind's host_us is its time
    per op, scaled so the ops' sum is the issue time (what else the host did shared out)."""
    ops = [op("gemm")] * 30 + [op("elementwise")] * 40
    bound = run(1.0e-3, 0.95e-3, ops)
    bound.host_issue_by_kind_s = {"0": {"gemm": 600e-6, "elementwise": 200e-6, "alloc": 100e-6}}
    base = CostModel(name="b", gemm=KernelCost(host_us=99.0), elementwise=KernelCost(host_us=99.0))
    kinds = {"gemm": KernelCost(), "elementwise": KernelCost()}
    d, _, _, report = gpu_host([bound], base, kinds, {}, {}, {}, start_kernels=False)
    assert report["host_us_measured"] == pytest.approx({"gemm": 20.0, "elementwise": 5.0})
    assert d["gemm"].host_us == pytest.approx(20.0 * 950 / 800)
    assert d["elementwise"].host_us == pytest.approx(5.0 * 950 / 800)
