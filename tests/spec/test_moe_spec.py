"""The model.moe block: validation (one message per rule), Hydra's schema, round trips."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from paratwin.config import CONF_DIR, job_from_cfg, register_schemas
from tests.conftest import cluster, gpt
from twin.spec import ConfigError, ParallelPlan, build_job
from twin.spec.io import job_from_dict, job_to_dict
from twin.spec.moe import MoESpec


@pytest.mark.parametrize("fields, message", [
    (dict(num_experts=0), r"model.moe.num_experts=0 must be a positive integer"),
    (dict(experts_per_token=9), r"experts_per_token=9 exceeds model.moe.num_experts=8"),
    (dict(shared_experts=-1), r"model.moe.shared_experts=-1 must be a whole number >= 0"),
    (dict(capacity_factor=0), r"model.moe.capacity_factor=0 must be a positive number"),
    (dict(routing="zipf"), r"model.moe.routing='zipf' is not one of uniform\|skewed"),
    (dict(routing_skew=0.5), r"routing_skew=0.5 needs model.moe.routing=skewed"),
    (dict(routing="skewed"), r"routing=skewed needs model.moe.routing_skew > 0"),
    (dict(routing="skewed", routing_skew=1.0), r"routing_skew=1.0 must be in \[0, 1\)"),
])
def test_moe_block_rules(fields, message):
    with pytest.raises(ConfigError, match=message):
        MoESpec(**fields)


def test_first_k_dense_must_leave_a_moe_layer():
    with pytest.raises(ConfigError, match=r"first_k_dense=8 leaves no MoE layer of "
                                          r"model.num_layers=8"):
        gpt(moe=MoESpec(first_k_dense=8))


def test_kv_channels_decouples_head_width_from_hidden():
    m = gpt(num_heads=8, num_kv_heads=8, kv_channels=64)  # q = 512 wide, h = 256
    assert m.head_dim == 64
    with pytest.raises(ConfigError, match=r"model.kv_channels=0 must be a positive integer"):
        gpt(kv_channels=0)


def test_job_round_trips_through_a_dict():
    m = gpt(activation="swiglu", moe=MoESpec(num_experts=4, experts_per_token=2,
                                             routing="skewed", routing_skew=0.3))
    job = build_job(m, cluster(gpus=4), ParallelPlan(ep=2))
    back = job_from_dict(job_to_dict(job))
    assert back.model == m and back.parallel.ep == 2


@pytest.fixture(scope="module")
def hydra_compose():
    register_schemas()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        yield lambda *overrides: compose(config_name="inspect", overrides=list(overrides))
    GlobalHydra.instance().clear()


def test_hydra_schema_takes_the_block_and_its_overrides(hydra_compose):
    cfg = hydra_compose("model=mixtral_8x7b", "cluster.num_nodes=2", "parallel=zero1",
                        "parallel.ep=8", "model.moe.routing=skewed", "model.moe.routing_skew=0.4")
    job = job_from_cfg(cfg)
    assert isinstance(job.model.moe, MoESpec)
    assert (job.model.moe.num_experts, job.model.moe.routing_skew, job.parallel.ep) == (8, 0.4, 8)
    dense = job_from_cfg(hydra_compose("model=llama3_8b"))
    assert dense.model.moe is None and dense.parallel.etp is None


def test_hydra_reports_a_bad_field_of_the_block(hydra_compose):
    with pytest.raises(ConfigError, match=r"parallel.ep=2 does not divide "
                                          r"model.moe.num_experts=3; use one of 1, 3"):
        job_from_cfg(hydra_compose("model=mixtral_8x7b", "model.moe.num_experts=3",
                                   "model.moe.experts_per_token=2", "parallel.ep=2",
                                   "parallel=zero1"))
