"""Jobs for schedule tests: every parallel preset on small clusters."""

from __future__ import annotations

from functools import cache

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from paratwin.config import CONF_DIR, job_from_cfg, register_schemas

PARALLEL = sorted(p.stem for p in (CONF_DIR / "parallel").glob("*.yaml"))


@cache
def preset_job(parallel: str, model: str = "tiny", cluster: str = "cpu_local",
               gpus: int | None = None, *extra: str):
    """The job of a parallel preset (world size 2, 3D at 4, single at 1, unless ``gpus``)."""
    register_schemas()
    gpus = gpus or {"single": 1, "3d": 4, "hsdp": 4}.get(parallel, 2)
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="schedule", overrides=[
            f"model={model}", f"cluster={cluster}", f"parallel={parallel}",
            f"cluster.gpus_per_node={gpus}", *extra])
    GlobalHydra.instance().clear()
    return job_from_cfg(cfg)
