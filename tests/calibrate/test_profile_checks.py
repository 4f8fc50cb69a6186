"""Profiles are checked when read: every key known (the closest one suggested), every number
in range, the file a profile at all; a profile fitted on another cluster warns; calibrate
writes only plain names into conf/profiles/."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import yaml
from omegaconf import OmegaConf

from paratwin.config import CONF_DIR, load_profile, preset_cluster
from paratwin.verbs.calibrate import check_writable, profile_path
from twin.cost import CostModel, KernelCost, default_cost_model
from twin.spec import ConfigError, ConfigWarning

CPU_PROFILE = CONF_DIR / "profiles" / "cpu_local.yaml"


def _data(**changes) -> dict:
    """The committed cpu_local profile's data with ``changes`` ('gemm.efficiency': -1)."""
    data = yaml.safe_load(CPU_PROFILE.read_text())
    for path, value in changes.items():
        *parents, key = path.split(".")
        node = data
        for p in parents:
            node = node[p]
        node[key] = value
    return data


def _error(data: dict) -> str:
    with pytest.raises(ConfigError) as err:
        CostModel.from_dict(data, "p.yaml")
    msg = str(err.value)
    assert msg.startswith("p.yaml: ") and "\n" not in msg
    assert msg.endswith("; correct the file or fit a new profile with `paratwin calibrate`")
    return msg


def test_the_committed_profile_and_the_defaults_load_clean():
    cost = CostModel.load(CPU_PROFILE)
    assert cost.name == "cpu_local" and cost.comm_cv > 0
    defaults = default_cost_model(preset_cluster("dgx_h100"))
    assert CostModel.from_dict(defaults.to_dict()) == defaults


@pytest.mark.parametrize("key, value, text", [
    ("gemm.efficiency", -0.5, "gemm.efficiency=-0.5 must be a finite number > 0 (fraction of "
                              "peak FLOP/s reached)"),
    ("gemm.efficiency", 0, "gemm.efficiency=0 must be a finite number > 0"),
    ("attention.mem_efficiency", float("nan"), "attention.mem_efficiency=nan must be a finite"),
    ("optimizer.launch_us", -3, "optimizer.launch_us=-3 must be a finite number >= 0 (fixed "
                                "cost per op, us)"),
    ("intra.latency_us", -1.0, "intra.latency_us=-1.0 must be a finite number >= 0"),
    ("inter.bw_efficiency", float("inf"), "inter.bw_efficiency=inf must be a finite number > 0"),
    ("base_latency_us", -8.4, "base_latency_us=-8.4 must be a finite number >= 0"),
    ("comm_cv", "high", "comm_cv='high' must be a finite number >= 0"),
    ("cores_effective", 0.0, "cores_effective=0.0 must be a finite number > 0"),
    ("kernels_by_dtype.bf16.gemm.efficiency", -1,
     "kernels_by_dtype.bf16.gemm.efficiency=-1 must be a finite number > 0"),
    ("collective_fits.all_reduce/intra/2.bw_GBps", 0,
     "collective_fits.all_reduce/intra/2.bw_GBps=0 must be a finite number > 0 (GB/s)"),
    ("core_share", "yes", "core_share='yes' must be true or false"),
])
def test_a_number_out_of_range_names_its_key_path(key, value, text):
    assert text in _error(_data(**{key: value}))


@pytest.mark.parametrize("key, text", [
    ("gemm.efficency", "unknown profile fields gemm.efficency (did you mean gemm.efficiency?)"),
    ("intra.bw_eff", "unknown profile fields intra.bw_eff (did you mean intra.bw_efficiency?)"),
    ("kernels_by_dtype.bf16.gemmm", "unknown profile fields kernels_by_dtype.bf16.gemmm (did "
                                    "you mean kernels_by_dtype.bf16.gemm?)"),
    ("compute_cvv", "unknown profile fields compute_cvv (did you mean compute_cv?)"),
    ("mystery", "unknown profile fields mystery (the fields: name, gemm, attention, "),
    ("collective_fits.all_reduce/intra/2.spread", "unknown profile fields collective_fits."
     "all_reduce/intra/2.spread (the fields of collective_fits.all_reduce/intra/2: latency_us, "
     "bw_GBps, residual_median, residual_max, points)"),
])
def test_an_unknown_key_anywhere_names_the_closest_known_one(key, text):
    value = {} if key.endswith("gemmm") else 1.0
    assert text in _error(_data(**{key: value}))


def test_an_unknown_key_inside_a_kernel_section_is_no_type_error(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(_data(**{"gemm.flops_per_s": 1.0})))
    with pytest.raises(ConfigError, match=r"p.yaml: unknown profile fields gemm.flops_per_s "
                                          r"\(the fields of gemm: efficiency, half_flops"):
        CostModel.load(path)


def test_malformed_sections_and_fit_names_are_named():
    data = _data()
    data["gemm"] = [0.7]
    data["collective_fits"]["all_reduce/ring/2"] = {"latency_us": 1.0, "bw_GBps": 1.0}
    data["collective_fits"]["broadcast/intra/2"] = {"latency_us": 1.0}
    msg = _error(data)
    assert "gemm=[0.7] must be a mapping of efficiency, half_flops, mem_efficiency, launch_us" \
        in msg
    assert "collective_fits.all_reduce/ring/2 must be named kind/link/n[@role] with link " \
           "intra or inter" in msg
    assert "collective_fits.broadcast/intra/2 needs latency_us and bw_GBps" in msg


def test_every_problem_is_named_at_once():
    msg = _error(_data(**{"gemm.efficiency": -1, "gemm.efficency": 1, "comm_cv": -0.1}))
    assert msg.count("; ") == 3


@pytest.mark.parametrize("content", [b"\x00\x01\xff", b"[1, 2", b"- 1\n- 2\n", b""])
def test_a_file_that_is_no_profile_is_refused(tmp_path, content):
    path = tmp_path / "p.yaml"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=f"{path} is not a paratwin calibration profile"):
        CostModel.load(path)


def test_calibration_pointing_at_a_directory_is_refused(tmp_path):
    cluster = preset_cluster("cpu_local")
    with pytest.raises(ConfigError) as err:
        load_profile(str(tmp_path), cluster)
    assert str(err.value) == (f"calibration={tmp_path} is a directory, not a profile; give a "
                              "profile file: a name in conf/profiles/ or a path to a .yaml")
    CostModel.load(CPU_PROFILE).save(tmp_path / "profile.yaml")  # a calibrate run directory
    with pytest.raises(ConfigError, match=f"give calibration={tmp_path / 'profile.yaml'}$"):
        load_profile(str(tmp_path), cluster)
    with pytest.raises(ConfigError, match="is a directory, not a profile"):
        CostModel.load(tmp_path)


def test_a_profile_from_another_cluster_warns_naming_both_and_the_fix():
    with pytest.warns(ConfigWarning) as got:
        load_profile("cpu_local", preset_cluster("dgx_h100"))
    (w,) = got
    assert str(w.message) == (
        "calibration=cpu_local: profile cpu_local was fitted on cluster cpu_local (a CPU "
        "profile) but this job runs on dgx_h100: its efficiencies and collective fits describe "
        "the other hardware; calibrate this one (`paratwin calibrate cluster=dgx_h100`) or "
        "leave calibration unset for the published defaults")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_profile("cpu_local", preset_cluster("cpu_local")).name == "cpu_local"
        assert load_profile(str(CPU_PROFILE), preset_cluster("cpu_local")).name == "cpu_local"


def test_cluster_match_uses_the_recorded_provenance():
    h100, h200, cpu = (preset_cluster(n) for n in ("dgx_h100", "dgx_h200", "cpu_local"))
    gpu = CostModel(name="g", provenance={"cluster": "dgx_h100", "backend": "nccl",
                                          "gpus": ["H100"]})
    assert gpu.cluster_mismatch(h100) is None
    assert "fitted on cluster dgx_h100 (a GPU profile) but this job runs on dgx_h200" \
        in gpu.cluster_mismatch(h200)
    # the same name on other hardware (a GPU profile on a CPU cluster) still warns
    renamed = dataclasses.replace(cpu, name="dgx_h100")
    assert "(a GPU profile) but this job runs on dgx_h100" in gpu.cluster_mismatch(renamed)
    # published defaults and hand-written profiles record no cluster: nothing to compare
    assert default_cost_model(h100).cluster_mismatch(cpu) is None
    assert CostModel(gemm=KernelCost()).cluster_mismatch(cpu) is None


# -- calibrate: where the profile goes ------------------------------------------------------

@pytest.mark.parametrize("name", ["../../x", "a/b", "/tmp/x", "x.yaml", ".hidden", "my profile"])
def test_calibrate_refuses_a_name_that_is_not_a_plain_file_stem(name):
    with pytest.raises(ConfigError) as err:
        profile_path(OmegaConf.create({"name": name, "out": None}), preset_cluster("cpu_local"))
    assert str(err.value) == (
        f"name={name!r} is not a plain profile name (letters, digits, '.', '_', '-'; no "
        "folders or .yaml): calibrate writes conf/profiles/NAME.yaml; to write the profile "
        "elsewhere give out=PATH")


def test_calibrate_paths(tmp_path):
    cpu = preset_cluster("cpu_local")
    assert profile_path(OmegaConf.create({"name": "h100-v2.1_a"}), cpu) == \
        CONF_DIR / "profiles" / "h100-v2.1_a.yaml"
    assert profile_path(OmegaConf.create({}), cpu) == CONF_DIR / "profiles" / "cpu_local.yaml"
    with pytest.raises(ConfigError, match="cluster.name='../x' is not a plain profile name"):
        profile_path(OmegaConf.create({}), dataclasses.replace(cpu, name="../x"))
    out = tmp_path / "any where" / "p.yaml"
    assert profile_path(OmegaConf.create({"name": "../../x", "out": str(out)}), cpu) == out
    with pytest.raises(ConfigError, match=f"out={tmp_path} is a directory; give the profile's "
                                          f"file path, e.g. out={tmp_path / 'cpu_local.yaml'}"):
        profile_path(OmegaConf.create({"out": str(tmp_path)}), cpu)


def test_calibrate_replaces_a_broken_profile_but_not_a_foreign_file(tmp_path):
    broken = tmp_path / "broken.yaml"
    broken.write_text(yaml.safe_dump(_data(**{"gemm.efficiency": -1})))
    check_writable(broken)  # a profile with bad values: the new fit may replace it
    foreign = tmp_path / "notes.yaml"
    foreign.write_text("keep: me\n")
    with pytest.raises(ConfigError, match="exists and is not a paratwin profile"):
        check_writable(foreign)


def test_the_cli_says_one_line_for_a_name_with_folders(tmp_path):
    from tests.cli.test_inspect_cli import paratwin

    out = paratwin("calibrate", "name=../../x", cwd=tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.splitlines() == [
        "paratwin calibrate: config error: name='../../x' is not a plain profile name (letters, "
        "digits, '.', '_', '-'; no folders or .yaml): calibrate writes conf/profiles/NAME.yaml; "
        "to write the profile elsewhere give out=PATH"]
    assert not (tmp_path.parent / "x.yaml").exists()


def test_shape_factors_round_trip_and_bad_ones_are_named(tmp_path):
    prof = CostModel(name="shaped", shape_factors={"gemm:fp16:2048x1536x1024": 1.25})
    back = CostModel.load(prof.save(tmp_path / "p.yaml"))
    assert back.shape_factors == {"gemm:fp16:2048x1536x1024": 1.25}
    data = _data()
    data["shape_factors"] = {"gemm:fp16:2048x1536x1024": -1, "conv:fp16:3x3": 1.0,
                             "attention:bf16:1x16x16x1024x64x1": 0.9}
    msg = _error(data)
    assert "shape_factors.gemm:fp16:2048x1536x1024=-1 must be a finite number > 0" in msg
    assert "shape_factors.conv:fp16:3x3 must be named kind:dtype:AxBxC with kind gemm or " \
           "attention" in msg
    assert "attention:bf16" not in msg
