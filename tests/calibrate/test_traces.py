"""`calibrate traces=`: the cost model fitted to executor run directories.

Synthetic runs: the twin simulates jobs under a known profile, and its trace is written as
an executor run would be; the fit must recover the profile's parameters (exactly without
noise, within a stated tolerance with lognormal noise on every op), and measure the
host gaps and arrival skew that were put in."""

from __future__ import annotations

import dataclasses
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import cluster, gpt
from twin.calibrate.profile import fit_collectives
from twin.calibrate.traces import (
    TraceError,
    fit_traces,
    latency_only,
    load_run,
    measurements,
    per_step,
    physical,
)
from twin.cost import CostModel, KernelCost, LinkCost
from twin.sim.engine import SimOptions
from twin.sim.run import simulate
from twin.spec import ParallelPlan, build_job
from twin.spec.io import job_to_dict

TRUE = CostModel(
    name="true", base_latency_us=0.0, intra=LinkCost(bw_efficiency=1.0),
    gemm=KernelCost(efficiency=0.6, mem_efficiency=0.8, launch_us=5.0),
    attention=KernelCost(efficiency=0.35, mem_efficiency=0.5, launch_us=12.0),
    elementwise=KernelCost(efficiency=0.5, mem_efficiency=0.7, launch_us=4.0),
    optimizer=KernelCost(efficiency=0.5, mem_efficiency=0.6, launch_us=8.0),
    collective_fits={f"{k}/intra/2": {"latency_us": 20.0, "bw_GBps": 150.0}
                     for k in ("all_reduce", "all_gather", "reduce_scatter")})


def _job(hidden: int, tp: int = 2, dp: int = 1):
    return build_job(gpt(hidden_size=hidden, num_heads=hidden // 64, num_kv_heads=hidden // 64,
                         num_layers=2, seq_len=2048),
                     cluster(1, tp * dp), ParallelPlan(tp=tp, dp=dp, sp=tp > 1, global_batch_size=2 * dp))


def _write_run(path: Path, job, noise: float = 0.0, seed: int = 0, steps: int = 3,
               gap_us: float = 0.0, skew_us: float = 0.0) -> Path:
    """A run directory as `paratwin execute` writes it, its spans from the twin: ``steps``
    copies of the simulated step, each op's duration times lognormal noise, ``gap_us``
    added before every compute op, and rank 1 arriving ``skew_us`` late at collectives."""
    res = simulate(job, TRUE, SimOptions(fold="none"))
    rng = random.Random(seed)
    spans, step_s = [], []
    for step in range(steps):
        for rank in sorted({s.rank for s in res.trace.spans}):
            shift = step * 10.0 * 1e6  # each compute op starts gap_us later than the one before
            for s in sorted((s for s in res.trace.spans if s.rank == rank), key=lambda s: s.start_us):
                if s.stream == "mem":
                    continue
                shift += gap_us if s.stream == "compute" else 0.0
                late = skew_us if s.stream != "compute" and rank == 1 else 0.0
                dur = s.dur_us * (rng.lognormvariate(0.0, noise) if noise else 1.0)
                start = s.start_us + shift + late
                spans.append(dataclasses.replace(s, step=step, start_us=start, end_us=start + dur))
        step_s.append(res.summary.step_time_s)
    trace = dataclasses.replace(res.trace, spans=spans)
    trace.meta.update(source="executor", job=job_to_dict(job), warmup=1, backend="nccl")
    path.mkdir(parents=True)
    trace.save(path / "spans.json")
    (path / "summary.json").write_text(json.dumps({
        "step_time_s": step_s[0], "step_time_p10_s": step_s[0], "step_time_p90_s": step_s[0]}))
    return path


def test_the_fit_recovers_the_kernel_and_collective_parameters(tmp_path):
    runs = [load_run(_write_run(tmp_path / f"h{h}", _job(h))) for h in (256, 512, 1024)]
    prof, report = fit_traces(runs, "fitted", CostModel())
    assert set(report["collectives"]) >= {"all_gather/intra/2", "reduce_scatter/intra/2"}
    assert prof.gemm.efficiency == pytest.approx(TRUE.gemm.efficiency, rel=0.02)
    assert prof.gemm.launch_us == pytest.approx(TRUE.gemm.launch_us, rel=0.05, abs=0.5)
    assert prof.attention.efficiency == pytest.approx(TRUE.attention.efficiency, rel=0.05)
    for kind in ("all_gather", "reduce_scatter"):
        fit = prof.collective_fits[f"{kind}/intra/2"]
        assert fit["bw_GBps"] == pytest.approx(150.0, rel=0.01), kind
        assert fit["latency_us"] == pytest.approx(20.0, rel=0.02), kind  # identical ranks: no skew
    assert all(g["step_mean"] == pytest.approx(0.0, abs=1e-6) for g in report["host_gap_us"].values())
    assert prof.provenance["source"] == "traces" and prof.provenance["cluster"] == runs[0].job.cluster.name


def test_the_fit_recovers_parameters_under_noise(tmp_path):
    runs = [load_run(_write_run(tmp_path / f"h{h}", _job(h), noise=0.15, seed=h, steps=6))
            for h in (256, 512, 1024)]
    prof, _ = fit_traces(runs, "fitted", CostModel())
    assert prof.gemm.efficiency == pytest.approx(TRUE.gemm.efficiency, rel=0.1)
    assert prof.attention.efficiency == pytest.approx(TRUE.attention.efficiency, rel=0.15)


def test_host_gaps_and_arrival_skew_are_measured(tmp_path):
    run = load_run(_write_run(tmp_path / "r", _job(512), gap_us=40.0, skew_us=100.0))
    _, _, gaps, _, skew, _ = measurements([run])
    assert gaps["gemm"] and min(v for _, v in gaps["gemm"]) == pytest.approx(40.0, abs=1e-6)
    assert {tag for tag, _ in gaps["gemm"]} == {(0, 1), (0, 2)}  # (run, measured step)
    # two members, rank 1 100 us late at every collective: the last arrives max - mean = 50 us
    # after the mean, pooled and under its role's key
    assert skew and all(v == pytest.approx(50.0) for vs in skew.values() for _, v in vs)
    assert any(k.endswith("@tp") for k in skew)
    prof, report = fit_traces([run], "fitted", CostModel())
    assert prof.gemm.host_us == pytest.approx(40.0, rel=0.01)  # a GPU run: the host's issue time
    assert report["host_gap_us"]["gemm"]["into"] == "host_us"


def test_bad_directories_are_one_line_each(tmp_path):
    with pytest.raises(TraceError, match="not a directory"):
        load_run(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(TraceError, match="no spans.json"):
        load_run(tmp_path / "empty")
    res = simulate(_job(256), TRUE)
    (tmp_path / "twin").mkdir()
    res.trace.save(tmp_path / "twin" / "spans.json")
    (tmp_path / "twin" / "summary.json").write_text(json.dumps({"step_time_s": 1.0}))
    with pytest.raises(TraceError, match="not measured by `paratwin execute`"):
        load_run(tmp_path / "twin")


def test_cli_refuses_a_foreign_directory_and_writes_nothing(tmp_path):
    (tmp_path / "notarun").mkdir()
    out = tmp_path / "prof.yaml"
    proc = subprocess.run([sys.executable, "-m", "paratwin.main", "calibrate",
                           f"traces={tmp_path / 'notarun'}", f"out={out}",
                           f"out_dir={tmp_path / 'cal'}"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    assert "no spans.json" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not out.exists() and not (tmp_path / "cal").exists()


def test_cli_fits_runs_and_prints_them_in_sample(tmp_path):
    dirs = [_write_run(tmp_path / f"h{h}", _job(h)) for h in (256, 512)]
    out = tmp_path / "prof.yaml"
    proc = subprocess.run([sys.executable, "-m", "paratwin.main", "calibrate",
                           f"traces=[{dirs[0]},{dirs[1]}]", f"out={out}",
                           f"out_dir={tmp_path / 'cal'}", "format=json"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert len(report["runs"]) == 2 and out.exists()
    for row in report["runs"]:  # the twin's own runs, refitted: predicted as simulated
        assert row["error"] == pytest.approx(0.0, abs=0.03)
    assert CostModel.load(out).gemm.efficiency == pytest.approx(TRUE.gemm.efficiency, rel=0.02)


def test_cli_prints_the_host_gaps_it_fitted(tmp_path):
    """The text output names each kind's host gap (what a typical step pays per op)."""
    dirs = [_write_run(tmp_path / f"h{h}", _job(h), gap_us=30.0) for h in (256, 512)]
    proc = subprocess.run([sys.executable, "-m", "paratwin.main", "calibrate",
                           f"traces=[{dirs[0]},{dirs[1]}]", f"out={tmp_path / 'p.yaml'}",
                           f"out_dir={tmp_path / 'cal'}"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    line = next(x for x in proc.stdout.splitlines() if "host gap between ops" in x)
    assert "gemm 30" in line, line


def test_each_group_role_gets_its_own_fit_and_the_twin_prefers_it(tmp_path):
    """kind/intra/n@role fits (tp, dp, ...) beside the pooled one; a collective of that role
    is timed by its own fit, others by the pooled one."""
    runs = [load_run(_write_run(tmp_path / f"h{h}", _job(h, tp=1, dp=2))) for h in (256, 512, 1024)]
    prof, report = fit_traces(runs, "fitted", CostModel())
    roles = {k.partition("@")[2] for k in report["collectives"]}
    assert "dp" in roles and "" in roles
    fast = {**prof.collective_fits["all_reduce/intra/2@dp"], "latency_us": 0.0}
    own = prof.collective_fit("all_reduce", "intra", 2, "dp")
    assert own["latency_us"] == pytest.approx(20.0, rel=0.02)
    prof = dataclasses.replace(prof, collective_fits={**prof.collective_fits,
                                                      "all_reduce/intra/2@dp": fast})
    assert prof.collective_fit("all_reduce", "intra", 2, "dp") is fast
    assert prof.collective_fit("all_reduce", "intra", 2, "tp")["latency_us"] > 0  # pooled
    assert CostModel.from_dict(prof.to_dict()).collective_fits == prof.collective_fits  # valid keys


def test_a_role_key_must_still_name_kind_link_and_size():
    from twin.cost import profile_problems

    data = CostModel().to_dict()
    data["collective_fits"] = {"all_reduce/intra/x@tp": {"latency_us": 1.0, "bw_GBps": 1.0}}
    assert any("kind/link/n[@role]" in p for p in profile_problems(data))


def test_a_bandwidth_the_sizes_cannot_separate_keeps_the_start_profiles():
    """Two sizes, the larger no slower (noise): the fitted bandwidth runs off to infinity;
    above 10x the link's nominal it is dropped and the start profile's bandwidth kept, the
    latency refitted under it."""
    rows = [{"kind": "reduce_scatter", "group_size": 2, "bytes": b, "time_s_median": t, "samples": n}
            for b, t, n in ((1e6, 0.0100, 1), (1e6, 0.0102, 1), (4e6, 0.0101, 10), (4e6, 0.0099, 10))]
    dropped: list[str] = []
    kept = physical(fit_collectives(rows)[0], 10 * 2.0, dropped)
    assert kept == {} and dropped == ["reduce_scatter/intra/2"]
    start = {"reduce_scatter/intra/2": {"latency_us": 50.0, "bw_GBps": 1.0}}
    fit = latency_only(rows, kept, start)["reduce_scatter/intra/2"]
    assert fit["bw_GBps"] == 1.0
    # the median of t - S / bw over the instances, (10.0 - 1, 10.2 - 1) ms once each and
    # (10.1 - 4, 9.9 - 4) ms ten times each: a row counts as often as it ran
    assert fit["latency_us"] == pytest.approx(6100, rel=1e-6)


def test_a_step_pays_the_tail_every_step_has_not_a_rare_stall():
    """per_step: each measured step's mean, then the median over steps. A 2 ms descheduling
    in every step among 19 gaps of 40 us counts ((19 * 40 + 2000) / 20 = 138 us); a 500 ms
    stall in one step of five does not."""
    samples = [((0, step), 40.0) for step in range(5) for _ in range(19)]
    samples += [((0, step), 2000.0) for step in range(5)]
    samples.append(((0, 3), 500e3))
    assert per_step(samples) == pytest.approx(138.0)
    assert per_step([((0, 0), 1.0), ((1, 0), 3.0), ((1, 0), 5.0)]) == pytest.approx(2.5)
