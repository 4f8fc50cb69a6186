"""What-ifs that cannot apply fail early, each message naming the field, the value and the fix."""

from __future__ import annotations

import re
import warnings
from dataclasses import replace

import pytest

from tests.conftest import cluster, gpt
from twin.cost import default_cost_model
from twin.sim.engine import SimOptions
from twin.sim.run import simulate
from twin.sim.whatif import check_options, parse_link
from twin.spec import (
    ClusterSpec,
    ConfigError,
    ConfigWarning,
    GPUSpec,
    InterNodeSpec,
    IntraNodeSpec,
    ParallelPlan,
    build_job,
)


@pytest.fixture(scope="module")
def two_nodes():
    """2 nodes x 8 GPUs, 8 NICs per node: world 16."""
    return build_job(gpt(), cluster(nodes=2), ParallelPlan(global_batch_size=16))


@pytest.mark.parametrize("text, res", [("nic_out:0:3", ("nic_out", 0, 3)), ("up:1", ("up", 1)),
                                       (" in:15 ", ("in", 15)), ("cpu:0", ("cpu", 0))])
def test_parse_link_gives_the_topologys_resource_tuple(text, res):
    assert parse_link(text) == res


@pytest.mark.parametrize("text, fix", [
    ("loop:0", "write one of nic_out:NODE:NIC, nic_in:NODE:NIC, up:NODE, down:NODE, out:RANK, "
               "in:RANK, cpu:NODE"),
    ("nic_out:a:b", "the indices must be integers; write nic_out:NODE:NIC (e.g. nic_out:0:0)"),
    ("nic_out:0", "nic_out takes 2 indices, got 1; write nic_out:NODE:NIC"),
    ("up", "up takes 1 index, got 0; write up:NODE (e.g. up:0)"),
])
def test_a_malformed_link_names_the_field_the_value_and_the_fix(text, fix):
    with pytest.raises(ConfigError) as err:
        parse_link(text)
    msg = str(err.value)
    assert msg.startswith(f"whatif.degraded_link={text!r}") and fix in msg
    assert "\n" not in msg


def test_a_link_missing_from_the_topology_lists_what_exists(two_nodes):
    with pytest.raises(ConfigError) as err:
        check_options(two_nodes, SimOptions(degraded={parse_link("nic_out:7:0"): 0.5}))
    msg = str(err.value)
    assert msg.startswith("whatif.degraded_link='nic_out:7:0' does not exist")
    assert "nic_out links are nodes 0..1, NICs 0..7" in msg and "e.g. nic_out:0:0" in msg


@pytest.mark.parametrize("link, exists", [("up:2", "nodes 0..1"), ("out:16", "ranks 0..15"),
                                          ("nic_in:1:8", "nodes 0..1, NICs 0..7")])
def test_every_kind_is_checked_against_the_topology(two_nodes, link, exists):
    with pytest.raises(ConfigError, match=f"links are {exists}; pick one of those"):
        check_options(two_nodes, SimOptions(degraded={parse_link(link): 0.5}))


def test_a_kind_the_cluster_lacks_lists_the_kinds_it_has(two_nodes):
    with pytest.raises(ConfigError) as err:
        check_options(two_nodes, SimOptions(degraded={("cpu", 0): 0.5}))
    assert "whatif.degraded_link='cpu:0'" in str(err.value)
    assert "has no cpu links; degrade one of its kinds: nic_out, nic_in, up, down, out, in" \
        in str(err.value)
    cpu = ClusterSpec(name="cpu", num_nodes=1, gpus_per_node=2, cores_per_node=2,
                      gpu=GPUSpec(peak_tflops={"bf16": 1.0}), intra=IntraNodeSpec(kind="shared_cpu"))
    job = build_job(gpt(), cpu, ParallelPlan(global_batch_size=2))
    check_options(job, SimOptions(degraded={("cpu", 0): 0.5}))
    with pytest.raises(ConfigError, match="has no out links; degrade one of its kinds: .*cpu"):
        check_options(job, SimOptions(degraded={("out", 0): 0.5}))


def test_an_unparsed_link_points_to_parse_link(two_nodes):
    with pytest.raises(ConfigError, match=r"whatif.degraded_link='nic_out:0:0' is not a fabric "
                                          r"resource.*twin.sim.whatif.parse_link"):
        check_options(two_nodes, SimOptions(degraded={"nic_out:0:0": 0.5}))


@pytest.mark.parametrize("rank", [16, -1, 1.5, True])
def test_a_straggler_outside_the_world_names_the_range(two_nodes, rank):
    with pytest.raises(ConfigError) as err:
        check_options(two_nodes, SimOptions(straggler={rank: 2.0}))
    assert str(err.value) == f"whatif.straggler_rank={rank!r} is out of range; pick a rank in 0..15"


@pytest.mark.parametrize("factor", [0.0, -1.0, float("nan"), float("inf"), "2"])
def test_factors_must_be_finite_and_positive(two_nodes, factor):
    with pytest.raises(ConfigError) as err:
        check_options(two_nodes, SimOptions(straggler={3: factor}))
    assert str(err.value).startswith(f"whatif.straggler_factor={factor!r} must be a finite "
                                      "number > 0 (2.0:")
    with pytest.raises(ConfigError) as err:
        check_options(two_nodes, SimOptions(degraded={("nic_out", 0, 0): factor}))
    assert str(err.value).startswith(f"whatif.degraded_factor={factor!r} must be a finite "
                                      "number > 0 (0.5:")


def test_every_problem_is_reported_at_once(two_nodes):
    opts = SimOptions(straggler={16: 0.0}, degraded={("nic_out", 7, 0): float("inf")})
    with pytest.raises(ConfigError) as err:
        check_options(two_nodes, opts)
    fields = [p.split("=")[0] for p in err.value.problems]
    assert fields == ["whatif.straggler_rank", "whatif.straggler_factor", "whatif.degraded_link",
                      "whatif.degraded_factor"]


def test_simulate_checks_its_options_before_simulating(two_nodes):
    with pytest.raises(ConfigError, match="nic_out:7:0"):
        simulate(two_nodes, options=SimOptions(degraded={("nic_out", 7, 0): 0.01}))


def test_a_valid_degraded_link_still_slows_the_step():
    job = build_job(gpt(hidden_size=1024, num_heads=8, num_kv_heads=8, ffn_hidden_size=4096),
                    ClusterSpec(name="2n", num_nodes=2, gpus_per_node=4,
                                gpu=GPUSpec(peak_tflops={"bf16": 300.0})),
                    ParallelPlan(global_batch_size=8))
    check_options(job, SimOptions())  # nothing to check: passes
    base = simulate(job).summary["step_time_s"]
    link = parse_link("nic_out:0:0")
    slow = simulate(job, options=SimOptions(degraded={link: 0.01})).summary["step_time_s"]
    assert slow > 2 * base


# -- values read from the config, warnings for what changes nothing ------------------------

def _cfg(**kw):
    from omegaconf import OmegaConf

    whatif = {"straggler_rank": None, "straggler_factor": 1.0, "degraded_link": None,
              "degraded_factor": 1.0}
    whatif.update(kw.pop("whatif", {}))
    return OmegaConf.create({"fold": "auto", "algorithm": "auto", "jitter": False, "seed": 0,
                             "whatif": whatif, **kw})


@pytest.mark.parametrize("cfg, text", [
    (dict(whatif={"straggler_rank": "abc", "straggler_factor": 2.0}),
     "whatif.straggler_rank='abc' must be a whole number (the rank that computes slower)"),
    (dict(whatif={"straggler_rank": 1, "straggler_factor": "abc"}),
     "whatif.straggler_factor='abc' must be a finite number > 0 (2.0:"),
    (dict(whatif={"degraded_link": "nic_out:0:0", "degraded_factor": "abc"}),
     "whatif.degraded_factor='abc' must be a finite number > 0 (0.5:"),
    (dict(seed="abc"), "seed='abc' must be a whole number >= 0 (jitter's random seed)"),
    (dict(seed=-1), "seed=-1 must be a whole number >= 0"),
    (dict(fold="some"), "fold='some' is not one of none|dp|tp|all|auto"),
])
def test_unreadable_values_are_config_errors(two_nodes, cfg, text):
    from paratwin.verbs.simulate import options_from_cfg

    with pytest.raises(ConfigError) as err:
        options_from_cfg(_cfg(**cfg), two_nodes)
    assert text in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("field, value", [("straggler_factor", 0), ("straggler_factor", -2.0),
                                          ("degraded_factor", 0), ("degraded_factor", -0.5),
                                          ("degraded_factor", float("nan")),
                                          ("degraded_factor", float("inf"))])
def test_a_zero_negative_or_non_finite_factor_is_refused_not_divided_by(two_nodes, field, value):
    from paratwin.verbs.simulate import options_from_cfg

    whatif = {"straggler_rank": 0, "straggler_factor": 2.0, "degraded_link": "nic_out:0:0",
              "degraded_factor": 0.5, field: value}
    opts = options_from_cfg(_cfg(whatif=whatif), two_nodes)
    with pytest.raises(ConfigError, match=rf"whatif.{field}=\S+ must be a finite number > 0"):
        simulate(two_nodes, options=opts)


@pytest.mark.parametrize("whatif, text", [
    ({"straggler_factor": 2.0}, "whatif.straggler_factor=2 has no effect without "
                                "whatif.straggler_rank; set whatif.straggler_rank=R"),
    ({"degraded_factor": 0.5}, "whatif.degraded_factor=0.5 has no effect without "
                               "whatif.degraded_link; set whatif.degraded_link="),
])
def test_a_factor_without_its_rank_or_link_warns(two_nodes, whatif, text):
    from paratwin.verbs.simulate import options_from_cfg

    with pytest.warns(ConfigWarning, match=re.escape(text)):
        opts = options_from_cfg(_cfg(whatif=whatif), two_nodes)
    assert opts.straggler == {} and opts.degraded == {}


@pytest.mark.parametrize("opts, text", [
    (SimOptions(straggler={3: 0.5}), "whatif.straggler_factor=0.5 < 1 makes rank 3 compute "
                                     "faster (the factor multiplies its compute time)"),
    (SimOptions(straggler={3: 1.0}), "whatif.straggler_factor=1 leaves whatif.straggler_rank=3 "
                                     "at full speed: the what-if changes nothing"),
    (SimOptions(degraded={("up", 1): 2.0}), "whatif.degraded_factor=2.0 > 1 makes up:1 faster"),
    (SimOptions(degraded={("up", 1): 1}), "whatif.degraded_factor=1 leaves up:1 at full "
                                          "bandwidth: the what-if changes nothing"),
])
def test_legal_but_suspicious_factors_warn(two_nodes, opts, text):
    with pytest.warns(ConfigWarning, match=re.escape(text)):
        check_options(two_nodes, opts)


def test_jitter_without_noise_in_the_profile_warns_and_names_the_fix(two_nodes):
    quiet = default_cost_model(two_nodes.cluster)
    with pytest.warns(ConfigWarning) as got:
        check_options(two_nodes, SimOptions(jitter=True), quiet)
    (w,) = got
    assert str(w.message) == (
        f"jitter=true changes nothing: profile {quiet.name} has no noise (compute_cv and "
        "comm_cv are 0); measure it with `paratwin calibrate` or give calibration= a profile "
        "with compute_cv/comm_cv")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_options(two_nodes, SimOptions(jitter=True), replace(quiet, comm_cv=0.1))
        check_options(two_nodes, SimOptions(jitter=False), quiet)


def test_a_straggler_folding_does_not_simulate_is_refused(two_nodes):
    with pytest.raises(ConfigError) as err:
        check_options(two_nodes, SimOptions(fold="dp", straggler={3: 2.0}))
    assert str(err.value) == (
        "whatif.straggler_rank=3 is not simulated with fold=dp (rank 0 is simulated for it); "
        "use whatif.straggler_rank=0 (the same step: a synchronous step waits for its slowest "
        "copy) or fold=none")
    check_options(two_nodes, SimOptions(fold="dp", straggler={0: 2.0}))


def test_a_degraded_link_without_traffic_warns_once():
    one_node = build_job(gpt(num_layers=2), cluster(nodes=1, gpus=2),
                         ParallelPlan(global_batch_size=2))
    with pytest.warns(ConfigWarning) as got:
        simulate(one_node, options=SimOptions(degraded={("nic_out", 0, 0): 0.5}), steps=2)
    assert [str(w.message) for w in got] == [
        "whatif.degraded_link=nic_out:0:0 carries no traffic in this job: the what-if changes "
        "nothing; degrade a link its flows cross"]
    with warnings.catch_warnings():  # a link the job's flows cross: no warning
        warnings.simplefilter("error")
        simulate(one_node, options=SimOptions(degraded={("out", 1): 0.5}))


def test_a_degraded_link_only_folded_copies_use_names_the_fold():
    # tp=2 folded: rank 1's data-parallel all-reduce (a copy of rank 0's) is the only user of
    # its node's second NIC
    job = build_job(gpt(), cluster(nodes=2, gpus=2, inter=InterNodeSpec(nics_per_node=2)),
                    ParallelPlan(tp=2, global_batch_size=2))
    with pytest.warns(ConfigWarning, match=r"nic_out:0:1 carries no traffic in this job as "
                                           r"simulated with fold=tp \(fold=none simulates every"):
        simulate(job, options=SimOptions(fold="tp", degraded={("nic_out", 0, 1): 0.5}))


def test_the_cli_says_one_line_for_a_zero_factor_and_warns_for_a_lone_one(tmp_path):
    from tests.cli.test_inspect_cli import paratwin

    base = ("simulate", "model=tiny", "cluster=cpu_local", "report=false")
    out = paratwin(*base, "whatif.degraded_link=cpu:0", "whatif.degraded_factor=0",
                   f"out_dir={tmp_path / 'a'}", cwd=tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.splitlines() == [
        "paratwin simulate: config error: whatif.degraded_factor=0.0 must be a finite number "
        "> 0 (0.5: the link keeps half its bandwidth)"]
    assert not (tmp_path / "a").exists()
    out = paratwin(*base, "whatif.straggler_factor=2", "jitter=true", "calibration=null",
                   f"out_dir={tmp_path / 'b'}", cwd=tmp_path)  # the defaults have no noise
    assert out.returncode == 0, out.stderr
    lines = out.stderr.splitlines()
    assert len(lines) == 2 and all(x.startswith("paratwin: warning: ") for x in lines)
    assert "whatif.straggler_factor=2 has no effect" in lines[0] and "jitter=true" in lines[1]


def test_nothing_is_warned_when_something_is_wrong(two_nodes):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a warning would surface instead of the error
        with pytest.raises(ConfigError, match="whatif.straggler_rank=16 is out of range"):
            check_options(two_nodes, SimOptions(straggler={16: 0.5}, jitter=True),
                          default_cost_model(two_nodes.cluster))
