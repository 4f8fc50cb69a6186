"""Sweeps (scaling efficiency) and calibration (benchmark points against the twin's model)."""

from __future__ import annotations

import csv
import dataclasses

import pytest

from paratwin.config import preset_cluster
from paratwin.verbs.report import bench_model
from tests.conftest import cluster
from twin.calibrate import predict
from twin.calibrate.profile import read_csv
from twin.cost import default_cost_model, ring_allreduce_time
from twin.report import calibration, sweep
from twin.report import rundir as rd
from twin.report.rundir import Run


def _run(name, world, tps):
    return Run(path=rd.Path(name), summary={"tokens_per_s": tps, "world_size": world,
                                            "peak_memory_max_bytes": 1e9, "mfu": 0.4})


def test_scaling_efficiency_and_speedup_labels():
    runs = [_run("a", 8, 1000.0), _run("b", 16, 1750.0), _run("c", 32, 3150.0)]
    assert sweep.has_scaling(runs)
    thr, eff = sweep.scaling_figures(runs)
    line = eff.data[0]
    assert list(line.y) == pytest.approx([100.0, 87.5, 78.75])
    assert list(line.text) == ["baseline", "x1.75 for x2 GPUs", "x1.80 for x2 GPUs"]
    assert list(thr.data[1].y) == pytest.approx([1000.0, 2000.0, 4000.0])  # the linear ideal


def test_real_sweep_groups_by_plan_family(runs):
    loaded = [rd.load(p) for p in rd.expand([runs["sweep"]])]
    assert [r.world_size for r in loaded] == [4, 8, 16]
    assert len({sweep.family(r) for r in loaded}) == 1 and sweep.has_scaling(loaded)
    assert sweep.family(loaded[0]) == "gpt, fsdp"


def test_one_gpu_count_has_no_scaling_figure():
    assert not sweep.has_scaling([_run("a", 8, 1.0), _run("b", 8, 2.0)])


def test_model_line_of_an_allreduce_is_the_ring_closed_form():
    """Alone on an NVSwitch node, the twin's all-reduce is base latency + the ring formula."""
    c = cluster(1, 8)
    cost = default_cost_model(c)
    for n, nbytes in ((2, 1e6), (8, 64e6)):
        t = predict.collective_time("all_reduce", n, nbytes, c, cost)
        bw = c.intra.bw_GBps * 1e9 * cost.intra.bw_efficiency
        want = cost.base_latency_us * 1e-6 + ring_allreduce_time(
            nbytes, n, bw, cost.link_latency_s(c, False))
        assert t == pytest.approx(want, rel=1e-6)


def test_kernel_model_is_compute_time_of_the_measured_op():
    c = cluster(1, 8)
    cost = default_cost_model(c)
    row = {"kind": "gemm", "dtype": "bf16", "shape": "1024x1024x1024", "flops": 2 * 1024 ** 3,
           "bytes": 6 * 1024 ** 2}
    k, f = cost.gemm, 2 * 1024 ** 3
    want = f / (100e12 * k.efficiency * f / (f + k.half_flops)) + k.launch_us * 1e-6  # roofline
    assert predict.kernel_time(row, c, cost) == pytest.approx(want, rel=1e-9)
    assert predict.base_kind("attention.bwd") == "attention"


def test_bench_csvs_read_tolerantly_and_drawn_with_the_model(bench_dir):
    run = rd.load(bench_dir)
    rows = read_csv(bench_dir / "collectives.csv")
    assert len(rows) == 7 and rows[0]["extra"] == "x" and rows[0]["bytes"] == 4096.0
    figs, note = calibration.calibration_figures(run, bench_model(None))
    assert "cpu_local with 2 ranks" in note
    coll, kern = figs
    names = {t.name for t in coll.data}
    assert names == {"2 ranks measured", "2 ranks twin"}
    assert sum(t.name == "2 ranks twin" for t in coll.data) == 3  # all_gather, all_reduce, sendrecv
    assert any(t.name.endswith("model") for t in kern.data)
    assert coll.layout.xaxis.type == "log" and coll.layout.yaxis.type == "log"
    # the line is the twin's prediction at each measured size, not a re-simulation of its own
    twin = next(t for t in coll.data if t.name == "2 ranks twin")
    c = dataclasses.replace(preset_cluster("cpu_local"), gpus_per_node=2)
    kind = coll.layout.annotations[0].text
    want = [predict.collective_time(kind, 2, x, c, default_cost_model(c)) * 1e6 for x in twin.x]
    assert list(twin.y) == pytest.approx(want)


def test_report_draws_modelled_csv_without_a_model(bench_dir, tmp_path):
    """A calibrate directory: the model is modelled.csv's column, drawn as written."""
    d = tmp_path / "cal"
    d.mkdir()
    rows = [{"table": "collective", "kind": "all_reduce", "dtype": "", "group_size": 2,
             "shape": "", "bytes": b, "flops": 0.0, "time_s_median": t, "time_s_p10": t,
             "time_s_p90": t, "time_s_model": 2 * t, "error": 1.0}
            for b, t in ((1e3, 1e-4), (1e6, 1e-3))]
    with (d / "modelled.csv").open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=predict.MODELLED_COLUMNS)
        w.writeheader()
        w.writerows(rows)
    run = rd.load(d)
    assert run.bench_csvs == [] and run.modelled_path == d / "modelled.csv"
    (coll,), note = calibration.calibration_figures(run)
    assert "modelled.csv" in note
    twin = next(t for t in coll.data if t.name == "2 ranks twin")
    assert list(twin.y) == pytest.approx([200.0, 2000.0])
    measured = next(t for t in coll.data if t.name == "2 ranks measured")
    assert list(measured.y) == pytest.approx([100.0, 1000.0])


def test_unknown_cluster_draws_points_only_and_says_why(bench_dir, tmp_path):
    d = tmp_path / "b"
    d.mkdir()
    (d / "collectives.csv").write_text((bench_dir / "collectives.csv").read_text())
    figs, note = calibration.calibration_figures(rd.load(d), bench_model(None))
    assert "cluster=NAME" in note
    assert all(t.name.endswith("measured") for t in figs[0].data)
    with pytest.raises(ValueError, match="not a preset; choose one of"):
        calibration.calibration_figures(rd.load(d), bench_model("dgx_h1000"))
    figs, note = calibration.calibration_figures(rd.load(d), bench_model("dgx_h100"))
    assert "dgx_h100 (given)" in note
    _, note = calibration.calibration_figures(rd.load(d))
    assert "only the measured points" in note


def test_profile_yaml_in_the_directory_is_used(bench_dir, tmp_path):
    d = tmp_path / "p"
    d.mkdir()
    (d / "collectives.csv").write_text((bench_dir / "collectives.csv").read_text())
    (d / "meta.json").write_text('{"backend": "gloo", "world_size": 2}')
    cost = dataclasses.replace(default_cost_model(cluster()), name="fitted-here")
    cost.save(d / "profile.yaml")
    _, note = calibration.calibration_figures(rd.load(d), bench_model(None))
    assert "profile profile.yaml (fitted-here)" in note
