"""Every preset in every config group composes through Hydra and builds valid specs."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from paratwin.config import CONF_DIR, job_from_cfg, register_schemas, to_spec
from twin.spec import ClusterSpec, ModelSpec

PRESETS = {g: sorted(p.stem for p in (CONF_DIR / g).glob("*.yaml"))
           for g in ("model", "cluster", "parallel")}


@pytest.fixture(scope="module")
def hydra_compose():
    register_schemas()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        yield lambda *overrides: compose(config_name="inspect", overrides=list(overrides))
    GlobalHydra.instance().clear()


def test_the_issue_lists_are_all_there():
    assert set(PRESETS["model"]) >= {"tiny", "gpt2_small", "gpt3_175b", "llama3_8b",
                                     "llama3_70b", "llama3_405b"}
    assert set(PRESETS["cluster"]) >= {"cpu_local", "dgx_a100", "dgx_h100", "dgx_h200"}
    assert set(PRESETS["parallel"]) >= {"single", "dp", "ddp", "zero1", "zero2", "zero3", "fsdp",
                                        "tp", "tp_sp", "pp_gpipe", "pp_1f1b", "pp_interleaved",
                                        "3d"}


@pytest.mark.parametrize("name", PRESETS["model"])
def test_model_presets(hydra_compose, name):
    spec = to_spec(ModelSpec, hydra_compose(f"model={name}").model, "model")
    assert spec.name == name


@pytest.mark.parametrize("name", PRESETS["cluster"])
def test_cluster_presets(hydra_compose, name):
    spec = to_spec(ClusterSpec, hydra_compose(f"cluster={name}").cluster, "cluster")
    assert spec.name == name and spec.world_size >= 1


@pytest.mark.parametrize("name", PRESETS["parallel"])
def test_parallel_presets_on_cpu_local(hydra_compose, name):
    # world size 2 for every preset (the executor's replay size), 4 for 3D, 1 for single.
    ranks = {"single": 1, "3d": 4}.get(name, 2)
    cfg = hydra_compose("model=tiny", "cluster=cpu_local", f"parallel={name}",
                        f"cluster.gpus_per_node={ranks}")
    job = job_from_cfg(cfg)
    assert job.grid.world_size == ranks


@pytest.mark.parametrize("name", [p for p in PRESETS["parallel"] if p != "single"])
def test_parallel_presets_on_a_dgx_node(hydra_compose, name):
    job = job_from_cfg(hydra_compose("model=llama3_8b", "cluster=dgx_h100", f"parallel={name}"))
    assert job.grid.world_size == 8


def test_overrides_reach_every_field(hydra_compose):
    cfg = hydra_compose("model=llama3_70b", "cluster.num_nodes=8", "parallel.tp=8",
                        "parallel.recompute=selective", "cluster.gpu.hbm_GB=96",
                        "model.seq_len=4096")
    job = job_from_cfg(cfg)
    assert (job.parallel.dp, job.parallel.tp, job.parallel.recompute) == (8, 8, "selective")
    assert job.cluster.gpu.hbm_GB == 96 and job.model.seq_len == 4096


def test_presets_derive_model_style(hydra_compose):
    llama = to_spec(ModelSpec, hydra_compose("model=llama3_8b").model, "model")
    gpt = to_spec(ModelSpec, hydra_compose("model=gpt3_175b").model, "model")
    assert llama.norm == "rmsnorm" and not llama.bias
    assert gpt.norm == "layernorm" and gpt.position_embedding == "learned"
