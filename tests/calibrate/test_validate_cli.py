"""`paratwin validate` end to end at world size 2 (one small config), and calibrate from a bench dir."""

from __future__ import annotations

import csv
import json

import pytest

from tests.cli.test_inspect_cli import paratwin

pytest.importorskip("torch")


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_validate_one_config_end_to_end(tmp_path):
    out = paratwin("validate", "model=tiny", "suite=[ddp]", "info_suite=[]", "steps=2", "warmup=1",
                   "calibration=null", "report=false", f"out_dir={tmp_path / 'v'}",
                   "format=json", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout)
    (row,) = res["runs"]
    assert row["measured_p10_s"] <= row["measured_p50_s"] <= row["measured_p90_s"]
    assert row["predicted_s"] > 0 and isinstance(row["in_band"], bool)
    assert row["kinds"]["_join"]["unmatched"] == 0 and row["kinds"]["_join"]["matched"] > 0
    assert res["figures"]["runs"] == 1
    (attempt,) = row["sources"]["replay"]["attempts"]  # no max_spread: measured once
    assert attempt["dir"] == "execute" and attempt["measured_p50_s"] == row["measured_p50_s"]
    # resumable: a second run keeps the finished result
    again = paratwin("validate", "model=tiny", "suite=[ddp]", "info_suite=[]", "steps=2",
                     "warmup=1", "calibration=null", "report=false",
                     f"out_dir={tmp_path / 'v'}", "format=json", cwd=tmp_path)
    kept = json.loads(again.stdout)["runs"][0]
    assert kept["wall_s"] == row["wall_s"] and kept["predicted_s"] == row["predicted_s"]
    # resumed under another profile: the same measurement, predicted again, nothing executed
    before = sorted(p.name for p in (tmp_path / "v" / "ddp-w2").iterdir())
    other = paratwin("validate", "model=tiny", "suite=[ddp]", "info_suite=[]", "steps=2",
                     "warmup=1", "calibration=cpu_local", "report=false",
                     f"out_dir={tmp_path / 'v'}", "format=json", cwd=tmp_path)
    assert other.returncode == 0, other.stderr[-2000:]
    (moved,) = json.loads(other.stdout)["runs"]
    assert moved["predicted_s"] != row["predicted_s"] and moved["profile_id"] != row["profile_id"]
    for key in ("measured_p50_s", "measured_p10_s", "measured_p90_s", "wall_s"):
        assert moved[key] == row[key], key
    assert moved["sources"]["replay"]["attempts"] == row["sources"]["replay"]["attempts"]
    assert moved["error"] == pytest.approx(moved["predicted_s"] / row["measured_p50_s"] - 1)
    assert moved["kinds"]["_join"]["matched"] == row["kinds"]["_join"]["matched"]
    assert sorted(p.name for p in (tmp_path / "v" / "ddp-w2").iterdir()) == before
    # a kept measurement that is gone: one line naming it and the fix
    import shutil
    shutil.rmtree(tmp_path / "v" / "ddp-w2" / "execute")
    gone = paratwin("validate", "model=tiny", "suite=[ddp]", "info_suite=[]", "steps=2",
                    "warmup=1", "calibration=null", "report=false",
                    f"out_dir={tmp_path / 'v'}", cwd=tmp_path)
    assert gone.returncode != 0 and "resume=false" in gone.stderr.strip().splitlines()[-1]
    # a noisy run measured again (max_spread), into a directory of its own; the narrowest kept
    out = paratwin("validate", "model=tiny", "suite=[ddp]", "info_suite=[]", "steps=2", "warmup=1",
                   "calibration=null", "report=false", f"out_dir={tmp_path / 'w'}",
                   "format=json", "max_spread=1e-9", "retries=1", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    (row,) = json.loads(out.stdout)["runs"]
    attempts = row["sources"]["replay"]["attempts"]
    assert [a["dir"] for a in attempts] == ["execute", "execute.retry1"]
    assert row["measured_p50_s"] == min(attempts, key=lambda a: a["spread"])["measured_p50_s"]
    assert (tmp_path / "w" / "ddp-w2" / "execute.retry1" / "summary.json").exists()
    assert "measuring again (1/1)" in out.stderr


def _bench_dir(tmp_path):
    d = tmp_path / "bench"
    d.mkdir()
    (d / "collectives.csv").write_text(
        "kind,group_size,bytes,dtype,time_s_median,time_s_p10,time_s_p90,algbw_GBps,busbw_GBps,"
        "repeats,backend\n"
        + "".join(f"all_reduce,2,{s},fp32,{1e-4 + s / 2e9},{0.9e-4 + s / 2.1e9},"
                  f"{1.2e-4 + s / 1.9e9},0,0,5,gloo\n" for s in (4096, 65536, 1 << 20, 1 << 24)))
    (d / "kernels.csv").write_text(
        "kind,dtype,shape,flops,bytes,time_s_median,time_s_p10,time_s_p90,repeats,tflops,GBps,device\n"
        + "".join(f"gemm,fp32,{n}x{n}x{n},{2 * n**3},{12 * n * n},{2 * n**3 / 5e10 + 2e-5},"
                  f"{2 * n**3 / 5.2e10 + 2e-5},{2 * n**3 / 4.8e10 + 2e-5},5,0,0,cpu\n"
                  for n in (128, 256, 512, 1024)))
    return d


def test_calibrate_fits_a_bench_dir_and_refuses_foreign_files(tmp_path):
    bench = _bench_dir(tmp_path)
    prof = tmp_path / "p.yaml"
    out = paratwin("calibrate", f"bench_dir={bench}", f"out={prof}", "interference=false",
                   f"out_dir={tmp_path / 'c'}", "format=json", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    fit = res["collectives"]["all_reduce/intra/2"]
    assert fit["bw_GBps"] == pytest.approx(2.0, rel=0.05)
    assert fit["latency_us"] == pytest.approx(100.0, rel=0.1)
    assert res["kernels"]["gemm/fp32"]["params"]["efficiency"] * 0.071e12 == pytest.approx(5e10, rel=0.05)
    # the run directory holds each point measured beside the fitted profile's prediction
    with open(tmp_path / "c" / "modelled.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert {r["table"] for r in rows} == {"collective", "kernel"} and len(rows) == 8
    big = [r for r in rows if r["kind"] == "all_reduce" and float(r["bytes"]) == 1 << 24]
    assert abs(float(big[0]["error"])) < 0.1  # 16 MB: the bandwidth term, fitted to 2 GB/s
    # the report draws that table as written: the model line is modelled.csv's column
    from twin.calibrate.profile import read_modelled
    from twin.report import calibration
    from twin.report import rundir as rd

    (coll, _), note = calibration.calibration_figures(rd.load(tmp_path / "c"))
    assert "modelled.csv" in note
    twin = next(t for t in coll.data if t.name == "2 ranks twin")
    table = read_modelled(tmp_path / "c" / "modelled.csv")
    want = sorted((r["bytes"], r["time_s_model"] * 1e6) for r in table if r["table"] == "collective")
    assert list(twin.x) == [x for x, _ in want] and list(twin.y) == pytest.approx([y for _, y in want])
    rep = paratwin("report", str(tmp_path / "c"), f"out={tmp_path / 'c.html'}", "chrome=false", cwd=tmp_path)
    assert rep.returncode == 0, rep.stderr
    assert "modelled.csv (the profile paratwin calibrate fitted there)" in (tmp_path / "c.html").read_text()
    sim = paratwin("simulate", "model=tiny", "cluster=cpu_local", f"calibration={prof}",
                   "report=false", "format=json", cwd=tmp_path)
    assert sim.returncode == 0 and json.loads(sim.stdout)["profile"] == "cpu_local"
    foreign = tmp_path / "notes.yaml"
    foreign.write_text("hello: world\n")
    bad = paratwin("calibrate", f"bench_dir={bench}", f"out={foreign}", "interference=false",
                   f"out_dir={tmp_path / 'd'}", cwd=tmp_path)
    assert bad.returncode == 2 and "was not overwritten" in bad.stderr
    assert foreign.read_text() == "hello: world\n"
