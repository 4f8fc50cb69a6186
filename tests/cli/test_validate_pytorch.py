"""`paratwin validate against=pytorch`: the twin held against PyTorch's own training, end to end."""

from __future__ import annotations

import json

import pytest

from tests.executor.helpers import paratwin


def test_against_must_be_one_of_the_sources(tmp_path):
    out = paratwin("validate", "against=foo", f"out_dir={tmp_path / 'v'}", cwd=tmp_path, timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "paratwin validate: config error: against='foo' is not one of replay|pytorch|both"]
    assert not (tmp_path / "v").exists()


@pytest.mark.parametrize("bad", ["max_spread=-0.1", "max_spread=abc", "retries=-1"])
def test_remeasure_options_are_checked(tmp_path, bad):
    out = paratwin("validate", bad, f"out_dir={tmp_path / 'v'}", cwd=tmp_path, timeout=60)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1
    assert bad.split("=")[0] in out.stderr and not (tmp_path / "v").exists()


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_validate_against_pytorch_times_real_training(tmp_path):
    pytest.importorskip("torch")
    args = ("validate", "model=tiny", "suite=[ddp,zero1]", "info_suite=[]", "steps=2", "warmup=1",
            "calibration=null", "report=false", "against=pytorch", f"out_dir={tmp_path / 'v'}",
            "format=json", "max_spread=1e-9", "retries=1")  # every run measured twice
    out = paratwin(*args, cwd=tmp_path, timeout=280)
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout)
    assert res["against"] == "pytorch" and set(res["sources"]) == {"pytorch"}
    assert res["sources"]["pytorch"]["runs"] == 1 and res["figures"] == res["sources"]["pytorch"]
    (skip,) = res["skipped"]  # ZeRO-1 has no PyTorch-native counterpart
    assert skip["name"] == "zero1-w2" and skip["source"] == "pytorch" and "zero_stage=1" in skip["reason"]
    (row,) = res["runs"]
    pt = row["sources"]["pytorch"]
    assert row["against"] == ["pytorch"] and row["error"] == pt["error"]
    assert pt["steps"] == 2 and len(pt["step_times_s"]) == 2 and pt["warmup"] == 1
    assert pt["measured_p10_s"] <= pt["measured_p50_s"] <= pt["measured_p90_s"]
    assert pt["predicted_s"] > 0 and isinstance(pt["in_band"], bool)
    assert pt["conformance"]["differences"] == 0
    kinds = pt["kinds"]
    assert kinds["gemm"]["measured_s"] > 0 and kinds["gemm"]["predicted_s"] > 0
    assert kinds["gemm"]["error"] is not None and kinds["_source"]["source"] == "torch.profiler"
    assert set(pt["torch_profile"]["ranks"]) == {"0", "1"}
    # the band (two steps) is wider than max_spread: measured again once, the narrowest kept
    assert [a["dir"] for a in pt["attempts"]] == ["pytorch", "pytorch.retry1"]
    kept = min(pt["attempts"], key=lambda a: a["spread"])
    assert pt["measured_p50_s"] == kept["measured_p50_s"]
    assert (tmp_path / "v" / "ddp-w2" / "pytorch.retry1" / "conformance" / "rank0.json").exists()
    saved = json.loads((tmp_path / "v" / "validate.json").read_text())
    assert saved["sources"] == res["sources"]
    assert json.loads((tmp_path / "v" / "ddp-w2" / "result.json").read_text())["sources"]["pytorch"]
    # resumable: a second run keeps the finished result
    again = paratwin(*args, cwd=tmp_path, timeout=120)
    assert json.loads(again.stdout)["runs"][0]["sources"]["pytorch"]["wall_s"] == pt["wall_s"]
    # under another profile: the same training's figures, the twin's side made again
    other = paratwin(*[a if a != "calibration=null" else "calibration=cpu_local" for a in args],
                     cwd=tmp_path, timeout=120)
    assert other.returncode == 0, other.stderr[-2000:]
    moved = json.loads(other.stdout)["runs"][0]["sources"]["pytorch"]
    assert moved["predicted_s"] != pt["predicted_s"] and moved["profile_id"] != pt["profile_id"]
    for key in ("measured_p50_s", "step_times_s", "attempts", "wall_s", "torch_profile"):
        assert moved[key] == pt[key], key
    assert moved["kinds"]["gemm"]["measured_s"] == kinds["gemm"]["measured_s"]
    assert moved["kinds"]["gemm"]["predicted_s"] != kinds["gemm"]["predicted_s"]
