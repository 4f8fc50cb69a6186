"""What-ifs that cannot apply fail early, each message naming the field, the value and the fix."""

from __future__ import annotations

import pytest

from tests.conftest import cluster, gpt
from twin.sim.engine import SimOptions
from twin.sim.run import simulate
from twin.sim.whatif import check_options, parse_link
from twin.spec import ClusterSpec, ConfigError, GPUSpec, IntraNodeSpec, ParallelPlan, build_job


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
